"""Read what `python -m build_engines.data.corpora prepare` wrote: the manifest, LM documents, labelled rows.

Why a reader instead of globbing files: the manifest is the index, so a consumer only sees sources that the last
prepare run actually produced (with their kind: base, chat, agent, code or design), and a directory that was never
prepared, or lacks a source, fails with a message that says which command fixes it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from build_engines.data.corpora.errors import DataNotPrepared
from build_engines.data.corpora.split import SPLITS
from build_engines.data.corpora.text_sources import KINDS

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def _prepare_hint(data_dir: Path) -> str:
    return f"run `python -m build_engines.data.corpora prepare --out {data_dir}`"


def load_manifest(data_dir: str | Path) -> dict[str, Any]:
    """The manifest of a prepared data directory."""
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST
    if not path.is_file():
        raise DataNotPrepared(f"no prepared data in {data_dir} ({MANIFEST} is missing): {_prepare_hint(data_dir)}")
    manifest: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataNotPrepared(f"{path} has format version {manifest.get('format_version')}, this reader needs "
                              f"{FORMAT_VERSION}: {_prepare_hint(data_dir)}")
    return manifest


def sources(data_dir: str | Path, kind: str | None = None) -> list[str]:
    """Names of the prepared LM sources, optionally only those of one kind (base, chat, agent, code, design)."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    manifest = load_manifest(data_dir)
    return sorted(name for name, entry in manifest["sources"].items() if kind is None or entry["kind"] == kind)


def _file(data_dir: Path, manifest: dict[str, Any], relative: str) -> Path:
    path = data_dir / relative
    if not path.is_file():
        raise DataNotPrepared(f"{path} is listed in the manifest but missing: {_prepare_hint(data_dir)}")
    return path


def _prepared_entry(data_dir: Path, manifest: dict, section: str, name: str, what: str) -> dict:
    """The manifest entry of one prepared source or labelled set; an unknown name gets an error listing what is."""
    if name not in manifest[section]:
        prepared = ", ".join(sorted(manifest[section])) or "none"
        raise DataNotPrepared(f"{what} {name!r} is not prepared in {data_dir} (prepared: {prepared}): "
                              f"{_prepare_hint(data_dir)}")
    return manifest[section][name]


def iter_records(data_dir: str | Path, source: str, split: str) -> Iterator[dict[str, str]]:
    """The {"doc_id", "text"} records of one source and split, in file order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    data_dir = Path(data_dir)
    manifest = load_manifest(data_dir)
    entry = _prepared_entry(data_dir, manifest, "sources", source, "source")
    path = _file(data_dir, manifest, entry["files"][split]["path"])
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            yield json.loads(line)


def iter_documents(data_dir: str | Path, source: str, split: str) -> Iterator[str]:
    """The texts of one source and split. Long documents come as consecutive parts (see `group_of`)."""
    for record in iter_records(data_dir, source, split):
        yield record["text"]


def load_labelled(data_dir: str | Path, name: str) -> list[dict[str, str]]:
    """All rows {"text", "label", "split"} of one labelled set."""
    data_dir = Path(data_dir)
    manifest = load_manifest(data_dir)
    entry = _prepared_entry(data_dir, manifest, "labelled", name, "labelled set")
    path = _file(data_dir, manifest, entry["file"]["path"])
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def group_of(doc_id: str) -> str:
    """The document group of a doc_id: the parts of a long document are `<group>#p001`, `<group>#p002`, ..."""
    return doc_id.split("#p", 1)[0]
