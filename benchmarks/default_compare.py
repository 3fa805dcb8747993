"""The embedded default before and after a rebuild, side by side in one run: routing, perplexities, drafter
acceptance and replay.

    .venv/bin/python -m benchmarks default-compare --before DIR [--after embedded/mol2-small]

- Routing: the served router's code (`RouterService.route`, the bundled adapters' descriptions, the shipped head) on
  the offline H19 of the natural-request and document-window benchmarks (`python -m build_engines.routing.data`
  writes them into artifacts/routing; made here when missing), for each model; and whether the embedding and the
  encoder layers are bitwise the same tensors (then H19, and so every routing decision, cannot differ).
- Perplexities: each model's manifest (test windows of every domain; base and each adapter on its own domain).
- Drafter acceptance: each manifest's drafter record (held-out prompts, mean accepted drafts of 5 per block).
- Replay: `ReplayExperiment` (the article's switch experiment) on a shorter history than docs/replay_quality.md
  (512 prompt + 64 reply tokens, 32-token turn, 64 forced tokens): whether every source gives bitwise the same
  logits for a target, and the bounded replay path against full recompute (logit MAE, top-1 agreement).

Writes the section "## Before and after: the structured-replies rebuild" of docs/model_card.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.harness import DOCS, EMBEDDED, ROOT, refuse_to_overwrite, write_section

SECTION = "## Before and after: the structured-replies rebuild"
DOMAIN_OF = {"L0_chat": "chat", "L1_agent": "agent", "L2_code": "code", "L3_design": "design"}


def shared_tensors_equal(before: Path, after: Path, n_encoder_layers: int) -> bool:
    """Embedding and encoder layers (what H19 and every cached prefix are made of) bitwise equal in both."""
    a, b = load_file(str(before / "model.safetensors")), load_file(str(after / "model.safetensors"))

    def shared(name: str) -> bool:
        parts = name.split(".")
        return name.startswith("embed") or (parts[0] == "layers" and int(parts[1]) < n_encoder_layers)

    names = sorted(n for n in a if shared(n))
    return bool(names) and all(n in b and torch.equal(a[n], b[n]) for n in names)


def routing(model: Path, routing_dir: Path, cache: Path) -> dict[str, float]:
    from build_engines.routing.data import load_items
    from build_engines.routing.train import extract_h19, model_digest
    from ced.formats.checkpoint import load_checkpoint
    from ced.model.network import EncoderEngine
    from ced.text.tokenizer import ChatTokenizer
    from tritonserver_backend.adapters.registry_init import ensure_registry
    from tritonserver_backend.core.router_service import RouterService

    items = {
        "natural requests": [i for i in load_items(routing_dir, "requests") if i["task"] == "request_benchmark"],
        "document windows": [i for i in load_items(routing_dir, "adapter") if i["task"] == "adapter_benchmark"],
    }
    with tempfile.TemporaryDirectory(prefix="mol2-compare-") as root:
        registry = ensure_registry(Path(root) / "registry", model)
        router = RouterService(model, registry)
        tok = ChatTokenizer.load(model)
        net = load_checkpoint(model)
        encoder = EncoderEngine.from_state_dict(net.cfg, net.state_dict()).eval()
        digest = model_digest(model)  # reads the whole checkpoint: once, not per benchmark
        out = {}
        for name, rows in items.items():
            features = extract_h19(encoder, tok, [i["query"] for i in rows], cache, digest)
            chosen = [registry.name_of(h) for h in router.route(list(features), [None] * len(features))]
            out[name] = sum(c == i["label"] for c, i in zip(chosen, rows)) / len(rows)
    return out


def perplexities(model: Path) -> dict[str, dict[str, float]]:
    return json.loads((model / "manifest.json").read_text())["perplexity"]["adapter_by_domain_test"]


def acceptance(model: Path) -> dict[str, float]:
    record = json.loads((model / "manifest.json").read_text()).get("drafter", {})
    return {name: row["trained"] for name, row in record.get("evaluation", {}).get("acceptance", {}).items()}


def replay(model: Path, data: Path) -> dict[str, float]:
    from benchmarks.replay_quality import load_model, text_tokens
    from build_engines.verify.replay_check import ReplayExperiment

    with tempfile.TemporaryDirectory(prefix="mol2-replay-") as work:
        net, adapters, _ = load_model(model, Path(work))
    prompt = text_tokens(model, data, 512, "base", 0)
    turn = text_tokens(model, data, 32, "chat", 0)
    if prompt is None or turn is None:
        raise SystemExit(f"no held-out text in {data}: run `python -m build_engines corpora prepare`")
    pairs, _ = ReplayExperiment(net, adapters).run(prompt, 64, turn, 64)
    identical = all(torch.equal(p.logits, next(q.logits for q in pairs if q.target == p.target)) for p in pairs)
    return {"sources_identical": float(identical),
            "path_mae": statistics.mean(p.path.logit_mae for p in pairs),
            "path_top1": statistics.mean(p.path.top1_agreement for p in pairs)}


def measure(model: Path, args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    record = {"routing": routing(model, args.routing, args.cache), "perplexity": perplexities(model),
              "acceptance": acceptance(model), "replay": replay(model, args.data)}
    record["seconds"] = time.perf_counter() - t0
    return record


def rows(before: dict, after: dict) -> list[tuple[str, str, str]]:
    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    out = [(f"routing: {k}", pct(before["routing"][k]), pct(after["routing"][k])) for k in before["routing"]]
    for name in ("BASE", *DOMAIN_OF):
        for domain in (DOMAIN_OF.values() if name == "BASE" else [DOMAIN_OF[name]]):
            b, a = before["perplexity"][name][domain], after["perplexity"][name][domain]
            label = f"perplexity: base on {domain}" if name == "BASE" else f"perplexity: {name} on its domain"
            if name != "BASE":
                b_gain = 1 - b / before["perplexity"]["BASE"][domain]
                a_gain = 1 - a / after["perplexity"]["BASE"][domain]
                out.append((label, f"{b:.1f} ({pct(b_gain)} below base)", f"{a:.1f} ({pct(a_gain)} below base)"))
            else:
                out.append((label, f"{b:.1f}", f"{a:.1f}"))
    for name in before["acceptance"]:
        out.append((f"drafter acceptance: {name} (of 5)", f"{before['acceptance'][name]:.2f}",
                    f"{after['acceptance'].get(name, float('nan')):.2f}"))
    out.append(("replay: every source gives the same logits", *(("yes" if r["replay"]["sources_identical"] else "NO")
                                                                for r in (before, after))))
    out.append(("replay: path vs full recompute, logit MAE", f"{before['replay']['path_mae']:.3g}",
                f"{after['replay']['path_mae']:.3g}"))
    out.append(("replay: path vs full recompute, top-1 agreement", f"{before['replay']['path_top1']:.4f}",
                f"{after['replay']['path_top1']:.4f}"))
    return out


def section(before: dict, after: dict, same_encoder: bool, args: argparse.Namespace) -> str:
    lines = [SECTION, "",
             f"Produced by `.venv/bin/python -m benchmarks default-compare --before {args.before}` "
             f"({time.strftime('%Y-%m-%d')}, {before['seconds'] + after['seconds']:.0f} s): the default before the "
             "structured-replies stage (the committed model of Dec 5) and after it, measured side by side. Embedding "
             f"and encoder layers bitwise equal in both: **{'yes' if same_encoder else 'no'}** (the stage trains the "
             "decoder only, so H19, the router's input, is unchanged). How each row is measured: "
             "`benchmarks/default_compare.py`.", "",
             "| figure | before | after |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows(before, after)]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True, help="the model folder before the rebuild")
    p.add_argument("--after", type=Path, default=EMBEDDED)
    p.add_argument("--data", type=Path, default=ROOT / "artifacts" / "data")
    p.add_argument("--routing", type=Path, default=ROOT / "artifacts" / "routing")
    p.add_argument("--cache", type=Path, default=ROOT / "artifacts" / "router_cache")
    p.add_argument("--doc", type=Path, default=DOCS / "model_card.md")
    p.add_argument("--force", action="store_true", help="overwrite the committed --doc file")
    args = p.parse_args()
    refuse_to_overwrite([args.doc], args.force, "--doc FILE")
    if not (args.routing / "requests.jsonl").exists():
        from build_engines.routing.data import main as routing_data

        routing_data(["--data", str(args.data), "--out", str(args.routing)])
    n_encoder_layers = json.loads((args.after / "config.json").read_text())["n_encoder_layers"]
    same = shared_tensors_equal(args.before, args.after, n_encoder_layers)
    before, after = measure(args.before, args), measure(args.after, args)
    text = section(before, after, same, args)
    write_section(args.doc, text, SECTION, "# Model card")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
