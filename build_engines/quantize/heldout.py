"""Held-out text for calibration (`val` split) and quantization checks (`test` split), per domain kind.

Why a committed sample: a quantized build must be reproducible from a fresh clone (CI has no prepared corpora and
preparing them needs the Debian archive), so the build calibrates on a small excerpt of the corpora's `val` split
that is committed next to the checkpoint (`<model>/heldout/val.jsonl`), and checks on an excerpt of `test`. Neither
split was trained on. `python -m build_engines.quantize.heldout` re-extracts both from `artifacts/data`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

KINDS = ("base", "chat", "agent", "code", "design")  # corpus kinds; each adapter is trained on one of the last four
SPLIT_CHARS = {"val": 6_000, "test": 12_000}  # characters per kind kept in the committed sample
DOC_CHARS = 2_000  # at most this much of one document, so a kind's sample spans several documents
HELDOUT_DIR = "heldout"


@dataclass(frozen=True)
class HeldoutText:
    """One split's excerpt: text per kind, where it came from, and a digest for the manifest."""

    split: str
    texts: dict[str, list[str]]  # kind -> excerpts (one per document)
    sources: dict[str, list[str]]  # kind -> corpus sources the excerpts come from
    origin: str  # the file or directory read
    sha256: str

    def describe(self) -> dict[str, object]:
        return {"split": self.split, "origin": self.origin, "sha256": self.sha256,
                "chars": {k: sum(map(len, v)) for k, v in self.texts.items()}, "sources": self.sources}


def extract(data_dir: Path, split: str, chars: int) -> list[dict[str, str]]:
    """The first `chars` characters of each kind's documents in `split` (sources in name order), as records."""
    from build_engines.data.corpora.reader import iter_documents, sources

    records = []
    for kind in KINDS:
        taken = 0
        for source in sorted(sources(data_dir, kind)):
            for doc in iter_documents(data_dir, source, split):
                piece = doc[: min(DOC_CHARS, chars - taken)]
                if len(piece.strip()) < 64:
                    continue
                records.append({"kind": kind, "split": split, "source": source, "text": piece})
                taken += len(piece)
                if taken >= chars:
                    break
            if taken >= chars:
                break
    return records


def load_heldout(model_dir: Path, split: str, data_dir: Path | None = None) -> HeldoutText:
    """The committed sample of `split` in `model_dir`, else the same excerpt taken from prepared corpora."""
    path = model_dir / HELDOUT_DIR / f"{split}.jsonl"
    if path.exists():
        raw = path.read_bytes()
        records = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
        origin = str(path)
    elif data_dir is not None and (data_dir / "manifest.json").exists():
        records = extract(data_dir, split, SPLIT_CHARS[split])
        raw = "\n".join(json.dumps(r, sort_keys=True) for r in records).encode()
        origin = f"{data_dir} ({split} split)"
    else:
        raise FileNotFoundError(f"no held-out text: neither {path} nor prepared corpora in {data_dir} "
                                f"(`python -m build_engines corpora prepare`)")
    texts: dict[str, list[str]] = {}
    srcs: dict[str, list[str]] = {}
    for r in records:
        texts.setdefault(r["kind"], []).append(r["text"])
        if r["source"] not in srcs.setdefault(r["kind"], []):
            srcs[r["kind"]].append(r["source"])
    return HeldoutText(split, texts, srcs, origin, hashlib.sha256(raw).hexdigest())


def token_sequences(heldout: HeldoutText, tokenizer_path: Path, length: int,
                    per_kind: int) -> dict[str, list[list[int]]]:
    """Up to `per_kind` sequences of exactly `length` token ids per kind (documents joined as the model saw them)."""
    from ced.text.tokenizer import ChatTokenizer

    tok = ChatTokenizer.load(tokenizer_path)
    out: dict[str, list[list[int]]] = {}
    for kind, texts in heldout.texts.items():
        ids: list[int] = []
        for text in texts:
            ids.extend(tok.document(text))
        out[kind] = [ids[i * length:(i + 1) * length] for i in range(min(per_kind, len(ids) // length))]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m build_engines.quantize.heldout", description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=Path("artifacts/data"), help="prepared corpora")
    p.add_argument("--model", type=Path, default=Path("embedded/mol2-small"),
                   help="the sample goes to <model>/heldout/")
    p.add_argument("--force", action="store_true",
                   help="overwrite committed held-out files (those of embedded/mol2-small are)")
    args = p.parse_args(argv)
    from build_engines.committed import refuse_to_overwrite

    refuse_to_overwrite([args.model / HELDOUT_DIR / f"{split}.jsonl" for split in SPLIT_CHARS], args.force,
                        "--model DIR")
    (args.model / HELDOUT_DIR).mkdir(parents=True, exist_ok=True)
    for split, chars in SPLIT_CHARS.items():
        records = extract(args.data, split, chars)
        path = args.model / HELDOUT_DIR / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
        print(f"wrote {path}: {len(records)} excerpts, {sum(len(r['text']) for r in records)} characters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
