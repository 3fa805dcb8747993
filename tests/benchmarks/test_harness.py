"""The benchmark harness: the doc sections a benchmark owns, the engines it needs, the server it measures, and the one
command that runs every benchmark."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import BENCHMARKS
from benchmarks.harness import (
    DEFAULT_ENGINES,
    EMBEDDED,
    ROOT,
    BenchmarkError,
    default_params,
    ensure_engines,
    served,
    write_section,
)


def test_paths_point_into_the_checkout() -> None:
    assert (ROOT / "pyproject.toml").is_file()
    assert (EMBEDDED / "config.json").is_file()
    assert DEFAULT_ENGINES.parent == ROOT / "artifacts" / "engines"


def test_write_section_replaces_only_its_own_section(tmp_path: Path) -> None:
    doc = tmp_path / "load.md"
    doc.write_text("# Serving under load\n\nintro\n\n## A (x.py)\nold a\n\n## B (y.py)\nkept b\n")
    write_section(doc, "## A (x.py)\nnew a\n", "## A (x.py)")
    assert doc.read_text() == "# Serving under load\n\nintro\n\n## A (x.py)\nnew a\n\n## B (y.py)\nkept b\n"
    write_section(doc, "## C (z.py)\nnew c\n", "## C (z.py)")  # a section the doc lacks is appended
    assert doc.read_text().endswith("## B (y.py)\nkept b\n\n## C (z.py)\nnew c\n")
    fresh = tmp_path / "new.md"
    write_section(fresh, "## D\nd\n", "## D", title="# Title")
    assert fresh.read_text() == "# Title\n\n## D\nd\n"


def test_default_params_name_the_default_and_take_overrides() -> None:
    params = default_params(max_context="2048")
    assert params == {"model_dir": str(EMBEDDED), "engine_dir": str(DEFAULT_ENGINES), "max_context": "2048"}


def test_ensure_engines_refuses_a_model_that_does_not_build(tmp_path: Path) -> None:
    with pytest.raises(BenchmarkError, match="did not build"):
        ensure_engines(tmp_path / "no-such-model", tmp_path / "engines")


def test_ensure_engines_reuses_current_engines(default_engines: Path) -> None:
    assert ensure_engines(EMBEDDED, default_engines) == default_engines


@pytest.mark.slow
def test_served_stops_the_server_when_the_benchmark_fails(tmp_path: Path, default_engines: Path) -> None:
    params = default_params(default_engines, registry_root=str(tmp_path / "registry"), max_context="2048")
    with pytest.raises(RuntimeError, match="benchmark failed"):
        with served(tmp_path, params) as server:
            assert server.is_running() and server.ready_seconds > 0
            raise RuntimeError("benchmark failed")
    assert not server.is_running()


def test_the_command_lists_every_benchmark_and_refuses_an_unknown_one() -> None:
    listed = subprocess.run([sys.executable, "-m", "benchmarks"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and all(name in listed.stdout for name in BENCHMARKS)
    unknown = subprocess.run([sys.executable, "-m", "benchmarks", "no-such-benchmark"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
    assert unknown.returncode == 2 and "unknown benchmark 'no-such-benchmark'" in unknown.stderr


def test_every_benchmark_module_exists() -> None:
    for name, (module, _) in BENCHMARKS.items():
        assert (ROOT / "benchmarks" / f"{module}.py").is_file(), name
