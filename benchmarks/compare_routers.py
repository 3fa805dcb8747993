"""The three routers on the adapter benchmark (analog of the article's Table 6): accuracy and time per decision.

    .venv/bin/python -m benchmarks compare-routers          # ~10 min on 2 CPU cores; writes docs/routing_routers.md

Every router answers through the same interface, `decide(conv, query_ids, options)`, on a conversation that holds
the benchmark query as its first user turn (<|bos|> + turn, encoded by the normal prefill), with the item's own
shuffled option order. MoL2 and Contextual MoL run on all benchmark items; MoL decodes up to 24 label tokens per
decision (about 0.7 s here), so it runs on a seeded class-balanced subset, and the other two are also reported on
that subset so the three columns compare the same questions.

- MoL2: the shipped pointer head (`<model>/router`).
- Contextual MoL: the q/k head fitted here on the adapter-routing train items (options encoded after each query;
  the encoder is frozen, features computed once).
- MoL: the L0 adapter decodes a label after the route prompt; the adapter is the chat adapter, not a routing-tuned
  one (the article's L0 was a random test adapter), so its accuracy is a reference, not a limit.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.harness import refuse_to_overwrite
from benchmarks.routing_latency import (
    fmt_time,  # the sibling benchmark's time format (scripts/ is on sys.path when run)
)
from build_engines.routing.baselines import ContextualMoLRouter, MoL2Router, MoLRouter, Router
from build_engines.routing.data import ADAPTER_DESCRIPTIONS, ADAPTER_TASK, BENCHMARK_TASK, load_items
from ced.conversation import Conversation
from ced.formats.checkpoint import load_checkpoint
from ced.lora import AdapterBank
from ced.text.tokenizer import ChatTokenizer, Message

L0 = "L0_chat"


def balanced_subset(items: list[dict], per_class: int, seed: int) -> list[dict]:
    rng = random.Random(f"compare:{seed}")
    out = []
    for label in ADAPTER_DESCRIPTIONS:
        rows = [it for it in items if it["label"] == label]
        out.extend(rng.sample(rows, min(per_class, len(rows))))
    return out


@torch.no_grad()
def first_turn(enc, dec, tok: ChatTokenizer,  # type: ignore[no-untyped-def]
               query: str) -> tuple[Conversation, list[int]]:
    """A fresh conversation whose normal prefill has encoded <|bos|> + the user turn (not part of the timing)."""
    conv = Conversation(enc, dec)
    qids = tok.turn(Message("user", query), generation_prompt=True)
    conv.extend(torch.tensor([[tok.bos_id, *qids]]))
    return conv, qids


def run_router(router: Router, items: list[dict], conversation) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Decide every item through the common interface; accuracy, per class, and decision times."""
    right: dict[str, list[bool]] = {label: [] for label in ADAPTER_DESCRIPTIONS}
    times = []
    for it in tqdm(items, desc=router.name, leave=False):
        conv, qids = conversation(it["query"])
        router.prepare(it["options"])
        decision = router.timed(conv, qids, it["options"])
        right[it["label"]].append(decision.index == it["answer"])
        times.append(decision.seconds)
    flat = [r for rows in right.values() for r in rows]
    return {"accuracy": sum(flat) / len(flat), "n": len(flat),
            "per_class": {k: sum(v) / len(v) for k, v in right.items() if v}, "mean_s": statistics.fmean(times),
            "median_s": statistics.median(times)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("embedded/mol2-small"))
    p.add_argument("--routing", type=Path, default=Path("artifacts/routing"))
    p.add_argument("--out", type=Path, default=Path("docs/routing_routers.md"))
    p.add_argument("--mol-per-class", type=int, default=50, help="MoL decisions per class (about 0.7 s each)")
    p.add_argument("--contextual-train", type=int, default=4000, help="adapter-routing train items for the q/k head")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite the committed --out file (docs/routing_routers.md)")
    args = p.parse_args()
    refuse_to_overwrite([args.out], args.force, "--out FILE")
    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    net = load_checkpoint(args.model)
    enc, dec = net.split()
    enc.eval(), dec.eval()
    bank = AdapterBank(net.cfg, dec)
    bank.attach(dec)
    adapters = bank.load_bundled(args.model)
    tok = ChatTokenizer.load(args.model)
    items = load_items(args.routing, "adapter")
    bench = [it for it in items if it["task"] == BENCHMARK_TASK]
    train = [it for it in items if it["task"] == ADAPTER_TASK and it["split"] == "train"][: args.contextual_train]

    mol2 = MoL2Router.from_model(args.model, net.embed.weight, tok)
    if not mol2.trained:
        raise SystemExit(f"no trained router head in {args.model / 'router'}: run "
                         "`python -m build_engines router --final-only` first")
    ctx = ContextualMoLRouter(enc, tok, seed=args.seed)
    t = time.perf_counter()
    losses = ctx.fit([(tok.turn(Message("user", it["query"]), generation_prompt=True), it["options"], it["answer"])
                      for it in tqdm(train, desc="Contextual MoL features", leave=False)], epochs=20, seed=args.seed)
    ctx_note = (f"q/k head fitted on {len(train)} adapter-routing train items in {time.perf_counter() - t:.0f} s (loss "
                f"{losses[0]:.3f} -> {losses[-1]:.3f})")
    mol = MoLRouter(tok, adapters.get(L0), max_label_tokens=24)

    def conversations(query: str) -> tuple[Conversation, list[int]]:
        return first_turn(enc, dec, tok, query)

    subset = balanced_subset(bench, args.mol_per_class, args.seed)
    results = {
        "full": {r.name: run_router(r, bench, conversations) for r in (mol2, ctx)},
        "subset": {r.name: run_router(r, subset, conversations) for r in (mol2, ctx, mol)},
    }
    wall = time.perf_counter() - t_start
    names = [mol.name, ctx.name, mol2.name]
    labels = list(ADAPTER_DESCRIPTIONS)
    lines = [
        "# The three routers on the adapter benchmark (analog of the article's Table 6)",
        "",
        f"Produced by `.venv/bin/python -m benchmarks compare-routers` in {wall / 60:.1f} min on this machine "
        f"(CPU, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads). Model `{args.model}`. Every decision goes through "
        "`Router.decide(conv, query_ids, options)` on a conversation holding the benchmark query as its first user "
        "turn, with the item's own shuffled options; times are the decision alone.",
        "",
        "- MoL2: the shipped pointer head; options through the token embedding only, cached. Contextual MoL: "
        f"{ctx_note}. MoL: the `{L0}` adapter decodes up to 24 label tokens after the route prompt (rolled back).",
        "",
        f"## Class-balanced subset ({len(subset)} items, {args.mol_per_class} per class, seeded): all three routers",
        "",
        "| | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
        "| decision | L0 adapter decodes a label | q/k head on H19 of query and options encoded after it | pointer "
        "head on H19 of the turn vs embedded options |",
        "| options enter the backbone | yes (encoder and decoder) | yes (encoder) | no |",
        "| temporary state after routing | route prompt and label, rolled back | temporary encoder branch, dropped | "
        "none |",
        "| accuracy | " + " | ".join(f"{100 * results['subset'][n]['accuracy']:.1f}% "
                                     f"({round(results['subset'][n]['accuracy'] * results['subset'][n]['n'])}/"
                                     f"{results['subset'][n]['n']})" for n in names) + " |",
    ]
    for label in labels:
        lines.append(f"| {label} | "
                     + " | ".join(f"{100 * results['subset'][n]['per_class'][label]:.0f}%" for n in names) + " |")
    lines += [
        "| time per decision, mean / median | "
        + " | ".join(f"{fmt_time(results['subset'][n]['mean_s'])} / {fmt_time(results['subset'][n]['median_s'])}"
                     for n in names) + " |",
        "",
        f"## Whole benchmark ({len(bench)} items): MoL2 and Contextual MoL",
        "",
        "| | " + " | ".join(n for n in names if n in results["full"]) + " |",
        "|---|" + "---|" * len(results["full"]),
        "| accuracy | "
        + " | ".join(f"{100 * results['full'][n]['accuracy']:.2f}%" for n in names if n in results["full"]) + " |",
    ]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(f"{100 * results['full'][n]['per_class'][label]:.1f}%" for n in names
                                                  if n in results["full"]) + " |")
    lines += [
        "| time per decision, mean / median | "
        + " | ".join(f"{fmt_time(results['full'][n]['mean_s'])} / {fmt_time(results['full'][n]['median_s'])}"
                     for n in names if n in results["full"]) + " |",
        "",
        "Decision times here are for first turns (short contexts) with the routers run one after another; the latency "
        "study by context length, with the routers interleaved, is `docs/routing_latency.md`.",
        "",
    ]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
