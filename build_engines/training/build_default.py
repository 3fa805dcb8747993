"""Build the embedded default from prepared corpora: tokenizer, trained small CED, four domain adapters.

`python -m build_engines.training.build_default --data artifacts/data --out embedded/mol2-small` runs every stage; each
stage is skipped when its output exists (and resumes from its training state when interrupted), so a re-run is
cheap and an interrupted run continues where it stopped. The result folder holds `config.json`,
`model.safetensors` (bf16), `tokenizer.json`, `adapters/<name>/` (PEFT layout) and `manifest.json` with hashes,
the exact command, timings and the perplexity tables.

`--answer-steps N` adds the answers stage (`answer_stage`): each domain adapter fine-tuned from its domain-text
version on request -> answer pairs. It is off (0) by default: measured at 250 steps, the answer-tuned adapters do
not yet put the request's key fact into their replies (docs/model_card.md), so the default keeps the domain-text
adapters.

`--drafter-steps N` (on by default) ends the build with the drafter stage (`drafter_stage`): the DSpark drafter
self-distilled from the finished base and adapters into `drafter/`, skipped when that folder exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from build_engines.committed import refuse_to_overwrite
from build_engines.data.corpora.reader import iter_documents, load_manifest, sources
from build_engines.data.token_data import Mixture, size_weights, token_stream, tokenizer_digest
from build_engines.training.answer_stage import add_arguments as add_answer_arguments
from build_engines.training.answer_stage import run_answer_stage, settings_from
from build_engines.training.drafter_stage import DataSettings as DrafterDataSettings
from build_engines.training.drafter_stage import TrainConfig as DrafterTraining
from build_engines.training.drafter_stage import run_stage as run_drafter_stage
from build_engines.training.structured_stage import (
    StructuredSettings,
    adapter_mixture,
    continue_base,
    structured_streams,
)
from build_engines.training.train import (
    TrainSettings,
    perplexity,
    pick_device,
    run_training,
    train_adapter,
    trainable_adapter,
)
from ced.formats.checkpoint import load_checkpoint, save_checkpoint
from ced.lora import AdapterBank
from ced.model.config import get_preset
from ced.model.network import CEDNetwork, init_weights
from ced.text.tokenizer import TOKENIZER_FILE, ChatTokenizer, train_tokenizer

DOMAINS = {"chat": "L0_chat", "agent": "L1_agent", "code": "L2_code", "design": "L3_design"}
MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_tokenizer(data: Path, out: Path, vocab: int, max_chars_per_source: int) -> ChatTokenizer:
    """BPE on the training split of every LM source (capped per source so no source dominates the merges)."""
    path = out / TOKENIZER_FILE
    if path.exists():
        return ChatTokenizer.load(path)

    def texts():  # type: ignore[no-untyped-def]
        for source in sources(data):
            budget = max_chars_per_source
            for doc in iter_documents(data, source, "train"):
                yield doc[:budget]
                budget -= len(doc)
                if budget <= 0:
                    break

    return train_tokenizer(texts(), vocab, path)


def _bf16_round_trip(net: CEDNetwork, out: Path) -> CEDNetwork:
    """Store the base in bf16 (the embedded size budget) and continue from exactly what was stored."""
    net = net.to(torch.bfloat16)
    save_checkpoint(net, out)
    return load_checkpoint(out, dtype=torch.float32)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("artifacts/data"))
    parser.add_argument("--out", type=Path, default=Path("embedded/mol2-small"))
    parser.add_argument("--work", type=Path, default=Path("artifacts/train"), help="resumable training state")
    parser.add_argument("--preset", default="mol2-small")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--base-steps", type=int, default=1000)
    parser.add_argument("--adapter-steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--domain-share", type=float, default=0.1,
                        help="share of base pre-training drawn from the adapter domains")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--eval-windows", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile the base training step")
    parser.add_argument("--structured-steps", type=int, default=StructuredSettings().steps,
                        help="continued training of the base's decoder on JSON records, tool use and JSON in code/CSS "
                        "(structured_stage; 0: none); the adapters then mix the same data into theirs")
    parser.add_argument("--structured-object-style", type=float, default=StructuredSettings().object_style_share,
                        help="share of the structured JSON replies written as the json_object grammar writes them "
                        "(', ' between members; the rest compact)")
    parser.add_argument("--reply-weight", type=float, default=StructuredSettings().reply_weight,
                        help="loss weight of the reply tokens of chat-formatted structured data, in the structured "
                        "stage and the adapters (reply_weights.py; 1: plain next-token loss)")
    parser.add_argument("--first-token-weight", type=float, default=StructuredSettings().first_token_weight,
                        help="times --reply-weight: the weight of each reply's first token (call or answer)")
    add_answer_arguments(parser, steps=0)
    parser.add_argument("--drafter-steps", type=int, default=DrafterTraining().steps,
                        help="last stage: self-distil the DSpark drafter into OUT/drafter/ (drafter_stage; skipped "
                        "when it exists; 0: no drafter)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: torch's default; 1 while others share the machine)")
    parser.add_argument("--force", action="store_true",
                        help="write into --out even where it holds committed files (the default --out, "
                        "embedded/mol2-small, is committed: its manifest and adapters would be rewritten)")
    args = parser.parse_args(argv)
    refuse_to_overwrite([args.out], args.force, "--out DIR (e.g. artifacts/mol2-small)")
    if args.threads:
        torch.set_num_threads(args.threads)

    started = time.perf_counter()
    device = pick_device()
    out, work = args.out, args.work
    out.mkdir(parents=True, exist_ok=True)
    data_manifest = load_manifest(args.data)
    timings: dict[str, float] = {}

    t = time.perf_counter()
    tok = build_tokenizer(args.data, out, args.vocab, 4_000_000)
    timings["tokenizer_s"] = time.perf_counter() - t
    digest = tokenizer_digest(out / TOKENIZER_FILE)
    cache = work / "tokens"
    base_sources = sources(args.data, "base")
    domain_sources = {d: sources(args.data, d) for d in DOMAINS}
    all_sources = base_sources + [s for d in DOMAINS for s in domain_sources[d]]
    t = time.perf_counter()
    streams = {split: {s: token_stream(args.data, s, split, tok, cache, digest) for s in all_sources}
               for split in ("train", "val", "test")}
    timings["tokenize_s"] = time.perf_counter() - t

    cfg = get_preset(args.preset, vocab_size=tok.vocab_size)
    base_dir = out
    weights = size_weights(streams["train"], base_sources)
    total_base = sum(weights.values())
    domain_all = [s for d in DOMAINS for s in domain_sources[d]]
    dw = size_weights(streams["train"], domain_all)
    total_dom = sum(dw.values())
    share = args.domain_share
    mixture_weights = ({s: (1 - share) * w / total_base for s, w in weights.items()}
                       | {s: share * w / total_dom for s, w in dw.items()})
    mixture = Mixture({s: streams["train"][s] for s in mixture_weights}, mixture_weights)
    if not (out / "model.safetensors").exists():
        torch.manual_seed(args.seed)
        net = CEDNetwork(cfg)
        init_weights(net)
        net.to(device)
        settings = TrainSettings(steps=args.base_steps, batch=args.batch, seq_len=args.seq_len, lr=2e-3, warmup=60,
                                 weight_decay=0.1, seed=args.seed, compile=args.compile and device.type == "cpu")
        t = time.perf_counter()
        history = run_training(net, list(net.parameters()), mixture, settings, work / "base", "base pre-training")
        timings["base_training_s"] = time.perf_counter() - t
        (work / "base" / "history.json").write_text(json.dumps(history))
        (work / "base" / "mixture.json").write_text(json.dumps(mixture_weights, indent=1))
        net = _bf16_round_trip(net.cpu(), base_dir).to(device)
    else:
        net = load_checkpoint(base_dir).to(device)

    # ------------------------------------------------- structured replies: the decoder's continued training
    structured_settings = StructuredSettings(steps=args.structured_steps,
                                             object_style_share=args.structured_object_style,
                                             reply_weight=args.reply_weight, first_token_weight=args.first_token_weight)
    structured = (structured_streams(out, args.data, cache, structured_settings, digest)
                  if args.structured_steps > 0 else {})
    reply_weights = structured_settings.reply_weights(tok.special_ids) if structured else None
    recorded = {k: v for k, v in (_stage_record(out, "structured") or {}).items() if k not in ("adapters", "tokens")}
    if args.structured_steps > 0 and recorded != structured_settings.record():
        t = time.perf_counter()
        structured_work = work / f"structured-{structured_settings.work_key()}"
        history = continue_base(net, mixture, structured, structured_settings, args.batch, args.seq_len,
                                structured_work, args.seed, reply_weights)
        timings["structured_training_s"] = time.perf_counter() - t
        (structured_work / "history.json").write_text(json.dumps(history))
        net = _bf16_round_trip(net.cpu(), base_dir).to(device)
        _write_stage_record(out, "structured", structured_settings.record()
                            | {"tokens": {k: int(v.shape[0]) for k, v in structured.items()}})
        _drop_stale_stages(out, work)
    if structured and (_stage_record(out, "structured") or {}).get("adapters") != structured_settings.adapter_record():
        _drop_stale_stages(out, work)  # the adapters' structured share changed: they (and the drafter) are retrained
        _write_stage_record(out, "structured", (_stage_record(out, "structured") or {})
                            | {"adapters": structured_settings.adapter_record()})

    adapters_dir = out / "adapters"
    for domain, name in DOMAINS.items():
        target = adapters_dir / name
        if (target / "adapter_model.safetensors").exists():
            continue
        adapter = trainable_adapter(net, name, f"adapters/{name}", args.rank, 2.0 * args.rank, True, args.seed + 1)
        domain_weights = size_weights(streams["train"], domain_sources[domain])
        if structured:
            mixture = adapter_mixture(domain, streams["train"], domain_weights, structured,
                                      structured_settings.adapter_share)
        else:
            mixture = Mixture({s: streams["train"][s] for s in domain_sources[domain]}, domain_weights)
        settings = TrainSettings(steps=args.adapter_steps, batch=args.batch, seq_len=args.seq_len, lr=3e-3, warmup=10,
                                 weight_decay=0.0, seed=args.seed + 1, checkpoint_every=40)
        t = time.perf_counter()
        train_adapter(net, adapter, mixture, settings, work / f"adapter_{name}", target, cfg.name, reply_weights)
        timings[f"adapter_{name}_s"] = time.perf_counter() - t

    # ------------------------------------------------------------- answers: request -> answer fine-tuning
    if args.answer_steps > 0:
        domain_train = {s: streams["train"][s] for d in DOMAINS for s in domain_sources[d]}
        timings |= run_answer_stage(net, tok, args.data, domain_train, adapters_dir, adapters_dir, work,
                                    settings_from(args), args.answer_train_pairs, args.answer_eval_requests)

    # ---------------------------------------------------------------------------------------- evaluation
    net = load_checkpoint(base_dir).to(device)
    bank = AdapterBank(net.cfg, net)
    bank.attach(net)
    adapters = {name: bank.load(adapters_dir / name, name=name, path_id=f"adapters/{name}")
                for name in DOMAINS.values()}
    t = time.perf_counter()
    base_ppl = {split: {s: perplexity(net, streams[split][s], args.seq_len, args.eval_windows) for s in all_sources}
                for split in ("val", "test")}
    domain_test = {d: domain_sources[d] for d in DOMAINS}
    table: dict[str, dict[str, float]] = {
        "BASE": {d: _mean_ppl(net, streams["test"], srcs, args, None) for d, srcs in domain_test.items()}
    }
    for name, adapter in adapters.items():
        table[name] = {d: _mean_ppl(net, streams["test"], srcs, args, adapter) for d, srcs in domain_test.items()}
    timings["evaluation_s"] = time.perf_counter() - t

    files = {p.relative_to(out).as_posix(): sha256(p) for p in sorted(out.rglob("*"))
             if p.is_file() and p.name != MANIFEST}
    manifest = {
        "preset": cfg.name,
        "config": cfg.to_dict(),
        "command": "python -m build_engines.training.build_default "
                   + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "settings": vars(args) | {"data": str(args.data), "out": str(args.out), "work": str(args.work)},
        "data_manifest_sha256": hashlib.sha256(json.dumps(data_manifest, sort_keys=True).encode()).hexdigest(),
        "tokenizer_sha256": sha256(out / TOKENIZER_FILE),
        "parameters": sum(p.numel() for p in net.parameters()),
        "adapters": {name: {"path": f"adapters/{name}", "hash": a.hash, "rank": a.rank, "alpha": a.alpha,
                            "modules": len(a.modules), "domain": d}
                     for (d, name), a in zip(DOMAINS.items(), adapters.values())},
        "perplexity": {"base_by_source": base_ppl, "adapter_by_domain_test": table},
        "timings_s": timings,
        "machine": {"device": str(device), "cpu_count": torch.get_num_threads(), "platform": platform.platform(),
                    "torch": torch.__version__},
        "files_sha256": files,
        "total_bytes": sum((out / f).stat().st_size for f in files),
        "wall_s": time.perf_counter() - started,
    }
    if args.answer_steps > 0:
        manifest["answers"] = answers_record(work, adapters_dir)
    manifest = merge_previous(out / MANIFEST, manifest)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    describe_adapters(out)
    record_smoke_generation(out)
    if args.drafter_steps > 0 and not (out / "drafter").exists():
        run_drafter_stage(out, args.data, work / "drafter", DrafterDataSettings(seed=args.seed),
                          DrafterTraining(steps=args.drafter_steps, seed=args.seed),
                          manifest["command"] + " (drafter stage)")
    print(json.dumps(manifest["perplexity"]["adapter_by_domain_test"], indent=1))
    print(f"embedded default written to {out} ({manifest['total_bytes'] / 1e6:.1f} MB)")


def _drop_stale_stages(out: Path, work: Path) -> None:
    """The base changed under the adapters and the drafter: their files and resumable states are stale."""
    import shutil

    stale = [out / "adapters" / name for name in DOMAINS.values()] + [out / "drafter"] \
        + [work / f"adapter_{name}" for name in DOMAINS.values()] + [work / "drafter"]
    for path in stale:
        if path.exists():
            print(f"the base changed: {path} is rebuilt")
            shutil.rmtree(path)


def _stage_record(out: Path, key: str) -> dict | None:
    """What the manifest in `out` says a stage ran with (None: not run): a stage that rewrites the base in place
    is skipped by this record, as the others are by their output files."""
    path = out / MANIFEST
    return json.loads(path.read_text()).get(key) if path.exists() else None


def _write_stage_record(out: Path, key: str, record: dict) -> None:
    path = out / MANIFEST
    manifest = json.loads(path.read_text()) if path.exists() else {}
    manifest[key] = record
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def answers_record(work: Path, adapters_dir: Path) -> dict:
    """The answers stage in the manifest: how the pairs were made and kept apart, and each adapter's run."""
    from build_engines.training.answer_tuning import STAGE_KEY

    pairs = json.loads((work / "answers" / "pairs" / "manifest.json").read_text())
    runs = {name: json.loads((adapters_dir / name / "adapter_config.json").read_text()).get(STAGE_KEY)
            for name in DOMAINS.values()}
    return {"pairs": pairs, "adapters": runs}


def merge_previous(path: Path, manifest: dict) -> dict:
    """A re-run that skipped stages keeps what the previous manifest measured for them (their timings, and keys
    other tools added such as notes), so the record of the whole build survives an incremental rebuild."""
    if not path.exists():
        return manifest
    previous = json.loads(path.read_text())
    before = previous.get("timings_s", {})
    cached = ("tokenizer_s", "tokenize_s")  # always timed, but only loaded from disk when the stage was skipped
    timings = before | {k: v for k, v in manifest["timings_s"].items()
                        if k not in before or (v > 0 and k not in cached)}
    merged = previous | manifest | {"timings_s": timings}
    merged["wall_s"] = max(manifest["wall_s"], sum(timings.values()))
    return merged


SMOKE_PROMPT = "Hello! What can you tell me about the sea?"
SMOKE_TOKENS = 8


@torch.no_grad()
def smoke_generation(model_dir: Path) -> dict[str, list[int]]:
    """Greedy tokens for a fixed chat prompt, base and every adapter: what the embedded-default test reproduces."""
    net = load_checkpoint(model_dir)
    tok = ChatTokenizer.load(model_dir)
    bank = AdapterBank(net.cfg, net)
    bank.attach(net)
    prompt = torch.tensor([tok.chat([{"role": "user", "content": SMOKE_PROMPT}])])
    out: dict[str, list[int]] = {}
    adapters = bank.load_bundled(model_dir)
    for name in ["BASE"] + sorted(adapters):
        adapter = adapters.get(name)
        with AdapterBank.rows([adapter]):
            o = net(prompt)
            state, ids = o.state, [int(o.logits[0, -1].argmax())]
            for _ in range(SMOKE_TOKENS - 1):
                o = net(torch.tensor([[ids[-1]]]), state)
                state = o.state
                ids.append(int(o.logits[0, -1].argmax()))
        out[name] = ids
    return out


def describe_adapters(model_dir: Path) -> None:
    """Write each adapter's router description (`mol2_description`) into its adapter_config.json, and refresh the
    manifest's hashes: the serving registry reads the same text the router was trained on."""
    from build_engines.routing.data import ADAPTER_DESCRIPTIONS

    manifest_path = model_dir / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    for name, text in ADAPTER_DESCRIPTIONS.items():
        cfg_path = model_dir / "adapters" / name / "adapter_config.json"
        if cfg_path.exists():
            meta = json.loads(cfg_path.read_text())
            meta["mol2_description"] = text
            cfg_path.write_text(json.dumps(meta, indent=2) + "\n")
            manifest["files_sha256"][f"adapters/{name}/adapter_config.json"] = sha256(cfg_path)
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")


def record_smoke_generation(model_dir: Path) -> None:
    path = model_dir / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["smoke_generation"] = {"prompt": SMOKE_PROMPT, "greedy_tokens": smoke_generation(model_dir)}
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def _mean_ppl(net: CEDNetwork, streams: dict, srcs: list[str], args: argparse.Namespace, adapter) -> float:  # type: ignore[no-untyped-def]
    """Token-weighted perplexity over a domain's test sources."""
    import math

    total_tokens = sum(min(streams[s].shape[0], args.eval_windows * args.seq_len) for s in srcs)
    log_sum = sum(math.log(perplexity(net, streams[s], args.seq_len, args.eval_windows, adapter))
                  * min(streams[s].shape[0], args.eval_windows * args.seq_len) for s in srcs)
    return math.exp(log_sum / max(1, total_tokens))


if __name__ == "__main__":
    main()
