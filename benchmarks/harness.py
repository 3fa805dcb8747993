"""What every benchmark shares: where things are, engines that are current, a served tritonserver, the doc section a
benchmark owns, and the refusal to overwrite committed figures by accident.

Benchmarks print ratios measured side by side in one run and write them into `docs/` as tables (and plots); tests
check behaviour, not timings. A benchmark is a module of this package with a `main()` that parses `sys.argv`, run as
`python -m benchmarks NAME` (`benchmarks/__main__.py` lists them).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from build_engines.committed import refuse_to_overwrite as refuse_to_overwrite

if TYPE_CHECKING:
    from tritonserver_backend.launcher import TritonServer

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED = ROOT / "embedded" / "mol2-small"
DEFAULT_ENGINES = ROOT / "artifacts" / "engines" / "mol2-small"
DOCS = ROOT / "docs"
FIGURES = DOCS / "figures"


class BenchmarkError(RuntimeError):
    """A benchmark cannot run here (its engines do not build, its server does not start); the message says why."""


def ensure_engines(model: Path = EMBEDDED, engines: Path = DEFAULT_ENGINES, *build_args: str) -> Path:
    """The ONNX engines of `model` in `engines`, built first when missing or stale (reused in seconds when current)."""
    from build_engines.build.cli import main as build

    if build(["--model", str(model), "--out", str(engines), *build_args]) != 0:
        raise BenchmarkError(f"the engines of {model} did not build into {engines} (the build's output says why)")
    return engines


def default_params(engines: Path = DEFAULT_ENGINES, model: Path = EMBEDDED, **params: str) -> dict[str, str]:
    """Repository parameters of a served default (`tritonserver_backend.repository`), `params` on top."""
    return {"model_dir": str(model), "engine_dir": str(engines), **params}


@contextmanager
def served(work: Path, params: dict[str, str], ready_timeout: float = 300.0) -> Iterator["TritonServer"]:
    """A tritonserver on a repository rendered from `params` into `work/repo`, ready; stopped (with its stubs) on
    exit, whatever happened. `server.ready_seconds` says how long it took to become ready."""
    from tritonserver_backend.launcher import TritonServer
    from tritonserver_backend.repository import build_repository

    server = TritonServer(work_dir=work / "server")
    server.start(build_repository(work / "repo", params))
    try:
        server.ready_seconds = server.wait_ready(ready_timeout)
        yield server
    finally:
        server.stop()


def save_figure(fig: Any, path: Path, dpi: int = 110) -> Path:
    """A benchmark's matplotlib figure into `path` (its folder made), laid out tight; the figure is closed."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def figure_link(figure: Path, doc: Path) -> str:
    """`figure`'s path as a doc at `doc` links to it (relative, wherever the two were written)."""
    return os.path.relpath(figure, doc.parent)


def write_section(path: Path, section: str, heading: str, title: str = "# Serving under load") -> None:
    """Replace (or append) a benchmark's own `## ...` section of a shared doc: `section` starts with `heading`;
    everything else in the file is kept."""
    text = path.read_text() if path.exists() else f"{title}\n\n"
    if heading in text:
        start = text.index(heading)
        rest = text[start + len(heading):]
        end = rest.find("\n## ")
        text = text[:start] + section.rstrip() + "\n" + (rest[end:] if end >= 0 else "")
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text)
