"""Write JSONL outputs and the manifest so that identical inputs give identical bytes.

Why so strict: the manifest's hashes are the proof that two runs (or two machines) prepared the same data, so
nothing machine- or time-dependent goes into any output: no timestamps, no output paths, keys sorted, UTF-8 kept
as is (`ensure_ascii=False`), `\\n` line ends. Files are written to a temporary name and renamed, so an interrupted
run never leaves a truncated file that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]], root: Path) -> dict[str, Any]:
    """Write one JSON object per line; return its record for the manifest (path relative to `root`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    count = size = 0
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as handle:
        for row in rows:
            line = (json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8")
            handle.write(line)
            digest.update(line)
            count += 1
            size += len(line)
    os.replace(partial, path)
    return {"path": path.relative_to(root).as_posix(), "sha256": digest.hexdigest(), "bytes": size, "rows": count}


def write_json(path: Path, data: Any) -> None:
    """A JSON document with sorted keys and a trailing newline, replaced atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, ensure_ascii=False, sort_keys=True, indent=2) + "\n", encoding="utf-8")
    os.replace(partial, path)
