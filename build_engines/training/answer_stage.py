"""The "answers" stage of the embedded default: request -> answer pairs, then each domain adapter fine-tuned on them.

Called by `build_default` after the domain-text adapters, and runnable alone so new adapters can be trained and
measured outside the shipped model first:

    .venv/bin/python -m build_engines.training.answer_stage --model embedded/mol2-small --out artifacts/answers/adapters

Idempotent and resumable: the pairs are built once per seed and data (`work/answers/pairs`), each adapter's
training state lives in `work/answers/<adapter>` (an interrupted run continues, a finished one is not redone), and
an adapter whose config already records this exact run (`mol2_training`: settings, pairs digest, starting adapter)
is skipped. The domain-text adapter a fine-tune starts from is kept in `work/domain_adapters/<adapter>` before the
answer-tuned one replaces it in the model folder, so the stage can be re-run and the two compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from build_engines.data.corpora.reader import sources
from build_engines.data.token_data import Mixture, size_weights, token_stream, tokenizer_digest
from build_engines.training.answer_pairs import ADAPTERS, write_answer_data
from build_engines.training.answer_tuning import (
    STAGE_KEY,
    AnswerSettings,
    encode_pair,
    is_done,
    stage_record,
    tune_adapter,
)
from ced.formats.checkpoint import load_checkpoint
from ced.lora.peft_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from ced.model.network import CEDNetwork
from ced.text.tokenizer import TOKENIZER_FILE, ChatTokenizer


def keep_domain_adapter(model_adapter: Path, keep: Path) -> Path:
    """The domain-text adapter to start from, kept in `keep`: a copy of `model_adapter` while that is still the
    domain-text adapter (refreshed when it changed), the kept copy once the model holds the answer-tuned one."""
    cfg = json.loads((model_adapter / ADAPTER_CONFIG).read_text())
    if STAGE_KEY in cfg:
        if not (keep / ADAPTER_WEIGHTS).exists():
            raise FileNotFoundError(f"{model_adapter} is already answer-tuned and {keep} holds no domain-text adapter "
                                    "to start from; restore the domain adapter there (or remove the model's adapter to "
                                    "retrain it)")
        return keep
    if ((keep / ADAPTER_WEIGHTS).exists()
            and (keep / ADAPTER_WEIGHTS).read_bytes() == (model_adapter / ADAPTER_WEIGHTS).read_bytes()):
        return keep
    shutil.rmtree(keep, ignore_errors=True)
    tmp = keep.with_name(keep.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model_adapter, tmp)
    tmp.rename(keep)
    return keep


def run_answer_stage(net: CEDNetwork, tok: ChatTokenizer, data_dir: Path, train_streams: dict[str, np.ndarray],
                     source_dir: Path, out_dir: Path, work: Path, settings: AnswerSettings,
                     train_per_domain: int, eval_per_domain: int, only: tuple[str, ...] = ()) -> dict[str, float]:
    """Fine-tune every domain adapter of `source_dir/<adapter>` into `out_dir/<adapter>`; returns seconds per
    adapter (0 for skipped ones). `train_streams`: the training token stream of every domain source; `only`: a
    subset of adapter names (empty: all), so separate processes can share the work."""
    torch.manual_seed(settings.seed)
    data = write_answer_data(data_dir, work / "answers" / "pairs", settings.seed, train_per_domain, eval_per_domain)
    timings: dict[str, float] = {}
    for kind, name in ADAPTERS.items():
        if only and name not in only:
            continue
        own = [(p["request"], p["answer"]) for p in data["train"] if p["adapter"] == name]
        start = keep_domain_adapter(source_dir / name, work / "domain_adapters" / name)
        record = stage_record(start, settings, hashlib.sha256(json.dumps(own).encode()).hexdigest())
        target = out_dir / name
        if is_done(target, record):
            timings[f"answers_{name}_s"] = 0.0
            continue
        pairs = [encode_pair(tok, request, answer, settings.seq_len + 1) for request, answer in own]
        srcs = sources(data_dir, kind)
        text = Mixture({s: train_streams[s] for s in srcs}, size_weights(train_streams, srcs))
        t = time.perf_counter()
        history = tune_adapter(net, start, name, pairs, text, settings, work / "answers" / name, target, record,
                               tok.pad_id)
        timings[f"answers_{name}_s"] = max(time.perf_counter() - t, training_seconds(history))
    return timings


def training_seconds(history: list[dict]) -> float:
    """Seconds spent on the steps of `history`, summed over every invocation that added to it (each resumed run
    restarts its clock), so a stage finished by an earlier run still reports what it cost."""
    total, last = 0.0, 0.0
    for entry in history:
        seconds = entry["seconds"]
        total += seconds - last if seconds >= last else seconds
        last = seconds
    return total


def add_arguments(parser: argparse.ArgumentParser, steps: int | None = None) -> None:
    """The stage's options, shared by this CLI and `build_default` (which passes `steps`=0: the stage is off in
    the default build until its adapters meet the goal in every domain; see docs/model_card.md)."""
    d = AnswerSettings()
    parser.add_argument("--answer-steps", type=int, default=d.steps if steps is None else steps,
                        help=f"answer fine-tuning steps per adapter (0: skip the stage; the recipe measured: "
                             f"{d.steps})")
    parser.add_argument("--answer-pair-rows", type=int, default=d.pair_rows)
    parser.add_argument("--answer-text-rows", type=int, default=d.text_rows, help="domain-text windows per step")
    parser.add_argument("--answer-seq-len", type=int, default=d.seq_len)
    parser.add_argument("--answer-lr", type=float, default=d.lr)
    parser.add_argument("--answer-train-pairs", type=int, default=1500, help="training pairs per domain")
    parser.add_argument("--answer-eval-requests", type=int, default=48, help="held-out evaluation requests per domain")


def settings_from(args: argparse.Namespace) -> AnswerSettings:
    return AnswerSettings(steps=args.answer_steps, pair_rows=args.answer_pair_rows, text_rows=args.answer_text_rows,
                          seq_len=args.answer_seq_len, lr=args.answer_lr, seed=args.seed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("embedded/mol2-small"),
                        help="base model and its domain adapters")
    parser.add_argument("--data", type=Path, default=Path("artifacts/data"))
    parser.add_argument("--out", type=Path, default=Path("artifacts/answers/adapters"))
    parser.add_argument("--work", type=Path, default=Path("artifacts/train"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 while others share the machine)")
    parser.add_argument("--adapters", nargs="*", default=[], help="only these adapters (default: all four)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = ChatTokenizer.load(args.model / TOKENIZER_FILE)
    digest = tokenizer_digest(args.model / TOKENIZER_FILE)
    streams = {s: token_stream(args.data, s, "train", tok, args.work / "tokens", digest)
               for kind in ADAPTERS for s in sources(args.data, kind)}
    net = load_checkpoint(args.model)
    timings = run_answer_stage(net, tok, args.data, streams, args.model / "adapters", args.out, args.work,
                               settings_from(args), args.answer_train_pairs, args.answer_eval_requests,
                               tuple(args.adapters))
    print(json.dumps(timings, indent=1))


if __name__ == "__main__":
    main()
