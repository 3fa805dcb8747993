"""Commands that write files the repository commits refuse to overwrite them unless told to.

The pipeline's defaults point at committed files: `python -m build_engines default` writes `embedded/mol2-small`,
`python -m build_engines router` the router head and `docs/routing.md`, the benchmarks their sections of `docs/*.md` and
`docs/figures/*`. Run by a newcomer on a checkout, such a command would silently rewrite what the tests check against.
So each one calls :func:`refuse_to_overwrite` before any work: when one of its outputs is a committed file that exists,
it stops with exit code 2 and says how to go on (`--force` to overwrite on purpose, or another output path). Outputs
under git-ignored folders (`artifacts/`, `build/`) are never committed and never refused.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Iterable

ROOT = Path(__file__).resolve().parent.parent
_NEVER_COMMITTED = ("artifacts", "build", ".venv", ".venv-dynamo", ".venv-quant", ".venv-aiperf")


def _tracked(rel: str) -> list[str] | None:
    """Files git tracks at or under ``rel`` (relative to the repository root); None when git cannot say."""
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--", rel], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return [name for name in done.stdout.split("\0") if name]


def committed(paths: Iterable[Path | str]) -> list[str]:
    """Of ``paths`` (files or folders, relative to the working directory), the committed files that exist now and
    would be overwritten, as paths relative to the repository root. Without git (an unpacked archive) every existing
    file inside the repository outside the git-ignored folders counts as committed."""
    found: list[str] = []
    for path in paths:
        target = Path(path).resolve()
        try:
            rel = target.relative_to(ROOT).as_posix()
        except ValueError:
            continue  # outside the repository
        if not target.exists() or rel.split("/", 1)[0] in _NEVER_COMMITTED:
            continue
        tracked = _tracked(rel)
        if tracked is None:
            files = [target] if target.is_file() else [p for p in target.rglob("*") if p.is_file()]
            tracked = [p.relative_to(ROOT).as_posix() for p in files]
        found += [name for name in tracked if (ROOT / name).is_file() and name not in found]
    return found


def refuse_to_overwrite(paths: Iterable[Path | str], force: bool, how: str = "") -> None:
    """Exit with code 2 when any of ``paths`` is (or holds) a committed file and ``force`` is false. ``how`` names
    the flag that writes elsewhere (e.g. "--out DIR"), shown in the message."""
    if force:
        return
    hits = []
    for path in paths:
        files = committed([path])
        if len(files) == 1 and Path(path).resolve() == (ROOT / files[0]).resolve():
            hits.append(files[0])
        elif files:
            hits.append(f"{Path(path).resolve().relative_to(ROOT).as_posix()}/: {len(files)} committed files")
    if not hits:
        return
    shown = ", ".join(hits)
    elsewhere = f", or write elsewhere with {how}" if how else ""
    print(f"error: this command would overwrite committed files ({shown}). Pass --force to overwrite them on purpose "
          f"(then review them with `git diff`){elsewhere}.", file=sys.stderr)
    raise SystemExit(2)
