"""The `prepare` step: fetch the pinned archives, extract and clean every source, split, write, and record it all.

Why one orchestrating function with small helpers: each stage (download.py, text_sources.py/labelled.py, clean.py,
split.py, output.py) stays testable on inline data, and this file only decides the order and what the manifest
says. The out directory holds exactly what the last run prepared: `--only` prepares a subset and leaves only it.
"""

from __future__ import annotations

import shutil
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from build_engines.data.corpora.clean import content_chars, normalize_text, split_long
from build_engines.data.corpora.download import fetch
from build_engines.data.corpora.errors import CorporaError, ExtractError
from build_engines.data.corpora.labelled import LABELLED, LabelledSet, deduplicate, text_key
from build_engines.data.corpora.output import write_json, write_jsonl
from build_engines.data.corpora.pins import PINS
from build_engines.data.corpora.reader import FORMAT_VERSION, MANIFEST, group_of
from build_engines.data.corpora.split import SPLITS, select_within_budget, split_groups, stratified_split
from build_engines.data.corpora.text_sources import KINDS, SOURCES, CorpusSource, ExtractContext

Log = Callable[[str], None]
T = TypeVar("T")

DEFAULT_SEED = 0
MAX_DOC_CHARS = 50_000  # longer documents become parts of the same group ("<group>#p001", ...)
MIN_CONTENT_CHARS = 64  # documents with fewer non-space characters are dropped as near-empty
EVAL_FRACTION = 0.05  # of each source's groups, for each of val and test ...
MIN_EVAL_GROUPS = 3  # ... but at least this many (at most a quarter of the groups)
LABELLED_FRACTIONS = (0.8, 0.1, 0.1)


def log_stderr(message: str) -> None:
    tqdm.write(message, file=sys.stderr)


def progress(items: Iterable[T], desc: str, unit: str) -> tqdm[T]:
    """A progress bar on stderr that disappears when done; use it as a context so an error closes it first."""
    return tqdm(items, desc=f"{desc:>14}", unit=f" {unit}", file=sys.stderr, mininterval=0.5, leave=False)


def select(only: Sequence[str] | None) -> tuple[list[CorpusSource], list[LabelledSet]]:
    """The corpus sources and labelled sets named in `only` (all when None); unknown names are an error."""
    if only is None:
        return list(SOURCES.values()), list(LABELLED.values())
    unknown = sorted(set(only) - set(SOURCES) - set(LABELLED))
    if unknown:
        raise CorporaError(f"unknown source(s) {', '.join(unknown)}; known corpus sources: {', '.join(SOURCES)}; "
                           f"labelled sets: {', '.join(LABELLED)}")
    return [s for s in SOURCES.values() if s.name in only], [s for s in LABELLED.values() if s.name in only]


def pin_record(package: str) -> dict[str, Any]:
    return asdict(PINS[package])


def build_documents(source: CorpusSource, ctx: ExtractContext, seed: int) -> tuple[dict[str, list[dict[str, str]]],
                                                                                    dict[str, Any]]:
    """Extract, clean, de-duplicate, cap and split one source; returns rows per split and the source's stats."""
    texts: dict[str, str] = {}
    extracted: set[str] = set()
    near_empty = 0
    with progress(source.extract(ctx), source.name, "docs") as bar:
        for group, raw in bar:
            if group in extracted:
                raise ExtractError(f"source {source.name} yields document group {group!r} twice")
            extracted.add(group)
            text = normalize_text(raw)
            if content_chars(text) < MIN_CONTENT_CHARS:
                near_empty += 1
                continue
            texts[group] = text

    seen: set[str] = set()
    duplicates = 0
    for group in sorted(texts):
        if texts[group] in seen:
            del texts[group]
            duplicates += 1
        else:
            seen.add(texts[group])

    kept = select_within_budget({g: len(t) for g, t in texts.items()}, source.max_chars, seed, source.name)
    assignment = split_groups(sorted(kept), seed, source.name, EVAL_FRACTION, MIN_EVAL_GROUPS)
    rows: dict[str, list[dict[str, str]]] = {split: [] for split in SPLITS}
    for group in sorted(kept):
        parts = split_long(texts[group], MAX_DOC_CHARS)
        for index, part in enumerate(parts, start=1):
            doc_id = group if len(parts) == 1 else f"{group}#p{index:03d}"
            rows[assignment[group]].append({"doc_id": doc_id, "text": part})
    stats = {"groups_extracted": len(extracted), "near_empty_dropped": near_empty,
             "duplicates_dropped": duplicates, "groups_dropped_by_cap": len(texts) - len(kept),
             "max_chars": source.max_chars}
    return rows, stats


def prepare_source(source: CorpusSource, archives: dict[str, Path], out_dir: Path, seed: int) -> dict[str, Any]:
    ctx = ExtractContext({p: archives[p] for p in source.pins})
    rows, stats = build_documents(source, ctx, seed)
    files = {}
    for split in SPLITS:
        record = write_jsonl(out_dir / "corpus" / source.name / f"{split}.jsonl", rows[split], out_dir)
        record["docs"] = record.pop("rows")
        record["groups"] = len({group_of(r["doc_id"]) for r in rows[split]})
        record["chars"] = sum(len(r["text"]) for r in rows[split])
        files[split] = record
    provenance = [pin_record(p) for p in source.pins]
    if "provenance" in ctx.notes:
        provenance.append(ctx.notes.pop("provenance"))
    return {"kind": source.kind, "description": source.description, "provenance": provenance,
            "notes": ctx.notes, "stats": stats, "files": files}


def family_split(family: str, archives: dict[str, Path], seed: int
                 ) -> tuple[dict[str, list[tuple[str, str]]], dict[str, int], dict[str, str]]:
    """Rows of every set in a family, rows dropped as duplicates per set, and the split of each text key.

    The whole family is extracted even when `--only` names one of its sets, so a set's split does not depend on
    which other sets were asked for. The stratum of a text is every (set, label) it carries.
    """
    rows: dict[str, list[tuple[str, str]]] = {}
    dropped: dict[str, int] = {}
    strata: dict[str, list[str]] = {}
    for item in (item for item in LABELLED.values() if item.family == family):
        rows[item.name], dropped[item.name] = deduplicate(
            list(item.extract(ExtractContext({p: archives[p] for p in item.pins}))))
        for text, label in rows[item.name]:
            strata.setdefault(text_key(text), []).append(f"{item.name}={label}")
    keys = sorted(strata)
    splits = stratified_split(["|".join(strata[key]) for key in keys], seed, family, LABELLED_FRACTIONS)
    return rows, dropped, dict(zip(keys, splits))


def prepare_labelled(item: LabelledSet, rows: list[tuple[str, str]], dropped: int, split_of: dict[str, str],
                     out_dir: Path) -> dict[str, Any]:
    splits = [split_of[text_key(text)] for text, _ in rows]
    record = write_jsonl(out_dir / "labelled" / f"{item.name}.jsonl",
                         ({"text": text, "label": label, "split": split}
                          for (text, label), split in zip(rows, splits)), out_dir)
    counts: dict[str, Counter[str]] = {label: Counter() for label in sorted({label for _, label in rows})}
    for (_, label), split in zip(rows, splits):
        counts[label][split] += 1
    return {"description": item.description, "family": item.family, "provenance": [pin_record(p) for p in item.pins],
            "duplicates_dropped": dropped, "labels": {k: {s: v[s] for s in SPLITS} for k, v in counts.items()},
            "file": record}


def _remove_stale(out_dir: Path, sources: set[str], labelled: set[str]) -> None:
    """Delete outputs of sources a previous run prepared but this one did not (only inside corpus/, labelled/)."""
    corpus = out_dir / "corpus"
    if corpus.is_dir():
        for path in corpus.iterdir():
            if path.is_dir() and path.name not in sources:
                shutil.rmtree(path)
    for path in (out_dir / "labelled").glob("*.jsonl"):
        if path.stem not in labelled:
            path.unlink()


def prepare(out_dir: Path, cache_dir: Path, seed: int = DEFAULT_SEED, only: Sequence[str] | None = None,
            log: Log = log_stderr) -> dict[str, Any]:
    """Run the whole data step; returns the manifest it wrote to `out_dir/manifest.json`."""
    sources, labelled = select(only)
    families = sorted({item.family for item in labelled})
    packages = sorted({p for source in sources for p in source.pins}
                      | {p for item in LABELLED.values() if item.family in families for p in item.pins})
    archives: dict[str, Path] = {}
    with progress(packages, "archives", "pkg") as bar:
        for package in bar:
            archives[package] = fetch(PINS[package], cache_dir, log)

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)  # until the new one is written, the directory is "not prepared"
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "generator": "python -m build_engines.data.corpora prepare",
        "seed": seed,
        "settings": {"max_doc_chars": MAX_DOC_CHARS, "min_content_chars": MIN_CONTENT_CHARS,
                     "eval_fraction": EVAL_FRACTION, "min_eval_groups": MIN_EVAL_GROUPS,
                     "labelled_fractions": list(LABELLED_FRACTIONS)},
        "kinds": {kind: [s.name for s in sources if s.kind == kind] for kind in KINDS},
        "sources": {},
        "labelled": {},
    }
    with progress(sources, "sources", "src") as bar:
        for source in bar:
            manifest["sources"][source.name] = prepare_source(source, archives, out_dir, seed)
            files = manifest["sources"][source.name]["files"]
            log(f"prepared    {source.name}: " + ", ".join(f"{s} {files[s]['docs']} docs" for s in SPLITS))
    with progress(families, "labelled", "family") as bar:
        for family in bar:
            rows, dropped, split_of = family_split(family, archives, seed)
            for item in (item for item in labelled if item.family == family):
                manifest["labelled"][item.name] = prepare_labelled(item, rows[item.name], dropped[item.name],
                                                                   split_of, out_dir)
                log(f"prepared    {item.name}: {manifest['labelled'][item.name]['file']['rows']} rows")
    manifest["totals"] = {
        "lm_bytes": sum(f["bytes"] for s in manifest["sources"].values() for f in s["files"].values()),
        "lm_chars": sum(f["chars"] for s in manifest["sources"].values() for f in s["files"].values()),
        "lm_docs": sum(f["docs"] for s in manifest["sources"].values() for f in s["files"].values()),
        "labelled_rows": sum(item["file"]["rows"] for item in manifest["labelled"].values()),
    }
    _remove_stale(out_dir, set(manifest["sources"]), set(manifest["labelled"]))
    write_json(out_dir / MANIFEST, manifest)
    return manifest
