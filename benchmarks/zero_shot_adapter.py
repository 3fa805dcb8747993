"""Zero-shot routing to a fifth adapter: train it, register it through adapter_admin with its description only,
route with the shipped head unchanged; write docs/routing_zero_shot.md.

    .venv/bin/python -m benchmarks zero-shot-adapter  # resumable: the adapter is trained once into artifacts/zero_shot

The new domain is Shakespeare's plays (the prepared `shakespeare` source; the router head never saw a request or a
window of it, and no description of it existed when the head was trained). The adapter is a LoRA trained like the
four bundled ones (same rank, steps, batch and window) on the plays' train split. It is registered the way an
operator does it on a running server: the `adapter_admin` service (`AdminService.handle("load", ...)`, with the admin
key) with the description in the request, not in the adapter's files. Routing is the served router's code
(`RouterService.route`) on the offline H19 of each request (equal to what serving pools, see
`test_offline_h19_with_history_equals_the_serving_path`). Reported: the fifth adapter's accuracy on its own
requests (from the plays' test split), and the four others' accuracy on the natural-request and document-window
benchmarks with four and with five adapters registered.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from benchmarks.harness import refuse_to_overwrite
from build_engines.data.corpora.reader import sources
from build_engines.data.token_data import Mixture, size_weights, token_stream, tokenizer_digest
from build_engines.routing.data import ADAPTER_DESCRIPTIONS, load_items
from build_engines.routing.report import adapter_scores, confusion_table
from build_engines.routing.requests import (
    ZERO_SHOT_ADAPTER,
    ZERO_SHOT_DESCRIPTION,
    ZERO_SHOT_KIND,
    ZERO_SHOT_REQUESTS,
    ZERO_SHOT_SOURCE,
    zero_shot_requests,
)
from build_engines.routing.train import extract_h19, model_digest
from build_engines.training.train import TrainSettings, perplexity, train_adapter, trainable_adapter
from ced.formats.checkpoint import load_checkpoint
from ced.lora import AdapterBank
from ced.model.network import EncoderEngine
from ced.text.tokenizer import TOKENIZER_FILE, ChatTokenizer
from tritonserver_backend.adapters.admin_service import AdminPolicy, AdminService
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.auth.admin_auth import admin_headers
from tritonserver_backend.core.router_service import RouterService

NAME, SOURCE, KIND, DESCRIPTION = ZERO_SHOT_ADAPTER, ZERO_SHOT_SOURCE, ZERO_SHOT_KIND, ZERO_SHOT_DESCRIPTION
# The bundled adapters' domain-text recipe as it was when docs/routing_zero_shot.md was measured (build_default
# now trains them 150 steps with structured data mixed in, issue 50; routing reads only H19, which that keeps).
RANK, STEPS, BATCH, SEQ_LEN, SEED, EVAL_WINDOWS = 16, 100, 6, 256, 0, 24


def train(model: Path, data: Path, work: Path) -> tuple[Path, dict[str, float]]:
    """The fifth adapter (trained once, resumable) and its perplexity against the base on the plays' test split."""
    tok = ChatTokenizer.load(model)
    digest = tokenizer_digest(model / TOKENIZER_FILE)
    streams = {split: token_stream(data, SOURCE, split, tok, work / "tokens", digest) for split in ("train", "test")}
    net = load_checkpoint(model)
    target = work / "adapters" / NAME
    if not (target / "adapter_model.safetensors").exists():
        adapter = trainable_adapter(net, NAME, f"adapters/{NAME}", RANK, 2.0 * RANK, True, SEED + 1)
        mixture = Mixture({SOURCE: streams["train"]}, size_weights({SOURCE: streams["train"]}, [SOURCE]))
        settings = TrainSettings(steps=STEPS, batch=BATCH, seq_len=SEQ_LEN, lr=3e-3, warmup=10, weight_decay=0.0,
                                 seed=SEED + 1, checkpoint_every=40)
        train_adapter(net, adapter, mixture, settings, work / f"adapter_{NAME}", target, net.cfg.name)
    net = load_checkpoint(model)
    bank = AdapterBank(net.cfg, net)
    bank.attach(net)
    loaded = bank.load(target, name=NAME, path_id=f"adapters/{NAME}")
    ppl = {"base": perplexity(net, streams["test"], SEQ_LEN, EVAL_WINDOWS),
           NAME: perplexity(net, streams["test"], SEQ_LEN, EVAL_WINDOWS, loaded)}
    return target, ppl


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("embedded/mol2-small"))
    p.add_argument("--data", type=Path, default=Path("artifacts/data"))
    p.add_argument("--routing", type=Path, default=Path("artifacts/routing"))
    p.add_argument("--cache", type=Path, default=Path("artifacts/router_cache"))
    p.add_argument("--work", type=Path, default=Path("artifacts/zero_shot"))
    p.add_argument("--out", type=Path, default=Path("docs/routing_zero_shot.md"))
    p.add_argument("--requests", type=int, default=ZERO_SHOT_REQUESTS, help="requests of the new domain")
    p.add_argument("--force", action="store_true",
                   help="overwrite the committed --out file and its figures' JSON (docs/routing_zero_shot.md, "
                   "docs/figures/)")
    args = p.parse_args()
    refuse_to_overwrite([args.out, args.out.parent / "figures" / "routing_zero_shot.json"], args.force, "--out FILE")
    t0 = time.perf_counter()
    if SOURCE not in sources(args.data):
        raise SystemExit(f"the {SOURCE} source is not prepared in {args.data}: run `python -m build_engines corpora "
                         "prepare`")
    adapter_dir, ppl = train(args.model, args.data, args.work)
    print(f"{NAME}: perplexity on the plays' test split: base {ppl['base']:.2f}, adapter {ppl[NAME]:.2f}")

    # a fresh registry with the bundled adapters, then the fifth one through adapter_admin (description in the request)
    root = args.work / "registry"
    shutil.rmtree(root, ignore_errors=True)
    registry = ensure_registry(root, args.model)
    router = RouterService(args.model, registry)
    shutil.copytree(adapter_dir, root / "adapters" / NAME)

    items = {
        "natural requests": [i for i in load_items(args.routing, "requests") if i["task"] == "request_benchmark"],
        "document windows": [i for i in load_items(args.routing, "adapter") if i["task"] == "adapter_benchmark"],
        f"{NAME} requests": zero_shot_requests(args.data, SOURCE, KIND, NAME, args.requests),
    }
    tok = ChatTokenizer.load(args.model)
    net = load_checkpoint(args.model)
    encoder = EncoderEngine.from_state_dict(net.cfg, net.state_dict()).eval()
    digest = model_digest(args.model)
    features = {name: extract_h19(encoder, tok, [i["query"] for i in rows], args.cache, digest)
                for name, rows in items.items()}

    def route(name: str) -> list[str]:
        hashes = router.route(list(features[name]), [None] * len(features[name]))
        return [registry.name_of(h) for h in hashes]  # type: ignore[arg-type]

    before = {name: route(name) for name in items if not name.startswith(NAME)}
    answer = json.loads(AdminService(args.model, registry, AdminPolicy(), log=lambda level, line: None).handle(
        "load", NAME, f"adapters/{NAME}", DESCRIPTION, admin_headers(root)))
    print(f"adapter_admin load: {answer}")
    assert [e.name for e in registry.entries()][-1] == NAME or NAME in [e.name for e in registry.entries()]
    after = {name: route(name) for name in items}
    labels4 = list(ADAPTER_DESCRIPTIONS)
    labels5 = labels4 + [NAME]
    results: dict = {"perplexity": ppl, "description": DESCRIPTION, "admin_answer": answer, "requests": {}}
    for name, rows in items.items():
        expected = [i["label"] for i in rows]
        res = {"five": adapter_scores(name, after[name], expected, labels5)}
        if name in before:
            res["four"] = adapter_scores(name, before[name], expected, labels4)
        results["requests"][name] = res
    results["examples"] = [{"query": i["query"], "routed": r}
                           for i, r in zip(items[f"{NAME} requests"][:8], after[f"{NAME} requests"][:8])]
    results["wall_s"] = time.perf_counter() - t0
    (args.out.parent / "figures").mkdir(parents=True, exist_ok=True)
    (args.out.parent / "figures" / "routing_zero_shot.json").write_text(json.dumps(results, indent=1) + "\n")
    write_report(args.out, results, items, labels4, labels5)
    return 0


def write_report(out: Path, results: dict, items: dict, labels4: list[str], labels5: list[str]) -> None:
    drama = f"{NAME} requests"
    r = results["requests"]
    lines = [
        "# Zero-shot routing to a fifth adapter",
        "",
        f"Produced by `.venv/bin/python -m benchmarks zero-shot-adapter` in {results['wall_s'] / 60:.1f} min. The new "
        f"adapter `{NAME}` is a rank-{RANK} LoRA trained like the bundled four ({STEPS} steps of {BATCH} x {SEQ_LEN} "
        f"tokens) on the train split of the prepared `{SOURCE}` source (Shakespeare's plays), a domain the router head "
        "never saw. It was registered through `adapter_admin` (`AdminService.handle('load', ...)` with the admin key) "
        "with its description in the request only:",
        "",
        f"> {DESCRIPTION}",
        "",
        "The router head (`embedded/mol2-small/router/`) is unchanged; routing is `RouterService.route` (the served "
        "router's code) on the first-turn H19 of each request. The new domain's requests come from the plays' test "
        "split (`requests.zero_shot_requests`: a character, a play title or a line, in benchmark-style phrasings).",
        "",
        f"Perplexity on the plays' test split: base {results['perplexity']['base']:.2f}, {NAME} "
        f"{results['perplexity'][NAME]:.2f} "
        f"({100 * (1 - results['perplexity'][NAME] / results['perplexity']['base']):.1f}% lower).",
        "",
        "| items | adapters registered | accuracy | " + " | ".join(labels5) + " |",
        "|---|---|---|" + "---|" * len(labels5),
    ]
    for name in items:
        for key, count in (("four", 4), ("five", 5)):
            if key not in r[name]:
                continue
            res = r[name][key]
            per = [f"{100 * res[f'{name}:{c}']:.1f}" if f"{name}:{c}" in res else "-" for c in labels5]
            lines.append(f"| {name} ({len(items[name])}) | {count} | {100 * res[name]:.2f} | " + " | ".join(per) + " |")
    lines += ["", f"Confusion matrix, {NAME} requests and the natural-request benchmark with five adapters registered:",
              ""]
    natural = r["natural requests"]["five"]["natural requests:confusion"]
    own = r[drama]["five"][f"{drama}:confusion"]
    lines += confusion_table([[a + b for a, b in zip(x, y)] for x, y in zip(natural, own)], labels5)
    own_acc = 100 * r[drama]["five"][drama]
    drops = {name: 100 * (r[name]["four"][name] - r[name]["five"][name]) for name in items if "four" in r[name]}
    worst = max(drops.values())
    verdict = "meets" if own_acc >= 70 and worst <= 3 else "does not meet"
    lines += ["", "Reading:", "",
              f"- The fifth adapter gets {own_acc:.1f}% of its own requests with no head retraining; registering it "
              "costs the four others "
              + ", ".join(f"{d:.1f} points on the {n}" for n, d in drops.items())
              + f". That {verdict} the issue's bar (>= 70%, the others down by at most 3 points).",
              "- How: the shipped head (recipe V, docs/routing.md) was trained with varied option sets: the adapter "
              "and request items with descriptions of other domains added beside the four adapters, and requests about "
              "those other domains (classic novels, news stories, films, products: "
              "`build_engines/routing/option_domains.py`) answered by their descriptions. It therefore reads what a "
              "description says instead of knowing four by heart. Neither Shakespeare's plays nor any description or "
              "phrasing of them is in that training.",
              "- The adapter itself is weak: "
              f"{100 * (1 - results['perplexity'][NAME] / results['perplexity']['base']):.1f}% lower perplexity than "
              f"the base after {STEPS} steps (the bundled adapters reach 11-26%).", ""]
    lines += ["", "Examples (first 8 of the new domain's requests):", ""]
    lines += [f"- `{e['query']}` -> {e['routed']}" for e in results["examples"]]
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
