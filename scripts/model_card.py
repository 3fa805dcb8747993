"""Write docs/model_card.md from the embedded default's manifest and the data manifest (no recomputation).

    .venv/bin/python scripts/model_card.py
Every figure comes from `embedded/mol2-small/manifest.json`, written by
`python -m build_engines.training.build_default`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from build_engines.committed import refuse_to_overwrite

DOMAIN_OF = {"L0_chat": "chat", "L1_agent": "agent", "L2_code": "code", "L3_design": "design"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("embedded/mol2-small"))
    p.add_argument("--data", type=Path, default=Path("artifacts/data"))
    p.add_argument("--out", type=Path, default=Path("docs/model_card.md"))
    p.add_argument("--force", action="store_true", help="overwrite the committed --out file (docs/model_card.md)")
    args = p.parse_args()
    refuse_to_overwrite([args.out], args.force, "--out FILE")
    m = json.loads((args.model / "manifest.json").read_text())
    data = json.loads((args.data / "manifest.json").read_text())
    cfg = m["config"]
    ppl = m["perplexity"]
    t = m["timings_s"]
    lines = [
        "# Model card: the embedded default `mol2-small`",
        "",
        "A small causal encoder-decoder with every structural role of DeepSeek-V4.1-Flash (see "
        "`docs/architecture.md`), trained from scratch on this project's offline corpora, plus four domain LoRA "
        f"adapters. Built by `{m['command']}`; all files and their sha256 are listed in `{args.model}/manifest.json` "
        f"({m['total_bytes'] / 1e6:.1f} MB in total, base weights stored in bf16).",
        "",
        "## Model",
        f"- {m['parameters'] / 1e6:.2f} M parameters; {cfg['n_layers']} layers (encoder "
        f"0-{cfg['n_encoder_layers'] - 1}, decoder {cfg['n_encoder_layers']}-{cfg['n_layers'] - 1}), dim {cfg['dim']}, "
        f"{cfg['n_heads']} heads x {cfg['head_dim']}, window {cfg['window_size']}, KV sources "
        f"{cfg['kv_source_layers']}, index layers {cfg['index_source_layers']}, {cfg['n_routed_experts']} routed "
        f"experts top-{cfg['n_activated_experts']} + {cfg['n_shared_experts']} shared, hc {cfg['hc_mult']} streams; "
        f"vocabulary {cfg['vocab_size']} (byte-level BPE trained on the training split, `tokenizer.json`, with chat "
        "special tokens).",
        f"- Training: {m['settings']['base_steps']} steps x {m['settings']['batch']} x {m['settings']['seq_len']} "
        f"tokens = {m['settings']['base_steps'] * m['settings']['batch'] * m['settings']['seq_len'] / 1e6:.2f} M "
        f"tokens, AdamW (lr 2e-3, warm-up, cosine), seed {m['settings']['seed']}; {m['settings']['domain_share']:.0%} "
        "of the mixture from the adapter domains."
        + _structured_line(m),
        f"- Machine: {m['machine']['device']}, {m['machine']['cpu_count']} threads, {m['machine']['platform']}, torch "
        f"{m['machine']['torch']}.",
        f"- Time: tokenizer {t.get('tokenizer_s', 0):.0f} s, tokenization {t.get('tokenize_s', 0):.0f} s, base "
        f"pre-training {t.get('base_training_s', 0) / 60:.1f} min (torch.compile included), "
        + (f"structured replies {t['structured_training_s'] / 60:.1f} min, " if "structured_training_s" in t else "")
        + ", ".join(f"{k.removeprefix('adapter_').removesuffix('_s')} {v / 60:.1f} min" for k, v in t.items()
                    if k.startswith("adapter_"))
        + "".join(f", answers {k.removeprefix('answers_').removesuffix('_s')} {v / 60:.1f} min" for k, v in t.items()
                  if k.startswith("answers_"))
        + f", evaluation {t.get('evaluation_s', 0) / 60:.1f} min; whole build {m['wall_s'] / 60:.1f} min.",
        "",
    ]
    lines += _drafter_lines(m)
    lines += [
        "## Training data (from `python -m build_engines.data.corpora prepare`; registry packages only)",
        "",
        "| source | kind | train docs | train MB | val docs | test docs |",
        "|---|---|---|---|---|---|",
    ]
    kinds = {s: k for k, ss in data["kinds"].items() for s in ss}
    for source, info in sorted(data["sources"].items()):
        f = info["files"]
        lines.append(f"| {source} | {kinds.get(source, '?')} | {f['train'].get('docs', '?')} | "
                     f"{f['train']['bytes'] / 1e6:.2f} | {f['val'].get('docs', '?')} | {f['test'].get('docs', '?')} |")
    lines += [
        "",
        "Domains of the adapters: L0_chat = movie dialogue (chat), L1_agent = Debian man pages of command-line tools "
        "(the closest honest offline stand-in for tool use: no registry ships agent transcripts), L2_code = Python "
        "standard library source, L3_design = CSS/SCSS/HTML of web-design npm packages.",
        "",
        "## Base perplexity per source (held-out documents)",
        "",
        "| source | val | test |",
        "|---|---|---|",
    ]
    for source in sorted(ppl["base_by_source"]["val"]):
        lines.append(f"| {source} | {ppl['base_by_source']['val'][source]:.1f} | "
                     f"{ppl['base_by_source']['test'][source]:.1f} |")
    table = ppl["adapter_by_domain_test"]
    domains = list(next(iter(table.values())).keys())
    lines += [
        "",
        "## Adapters: test perplexity on every domain, next to the base",
        "",
        "| model | " + " | ".join(domains) + " | own-domain gain vs base |",
        "|---|" + "---|" * (len(domains) + 1),
    ]
    for name, row in table.items():
        own = DOMAIN_OF.get(name)
        gain = f"{(1 - row[own] / table['BASE'][own]) * 100:.1f}% lower" if own else ""
        cells = [f"**{row[d]:.1f}**" if d == own else f"{row[d]:.1f}" for d in domains]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {gain} |")
    lines += ["", "Bold: the adapter's own domain. The goal is at least 10% lower perplexity than the base there; the "
                  "other columns show the off-domain cost.", ""]
    for name, info in m["adapters"].items():
        lines.append(f"- `{name}`: rank {info['rank']}, alpha {info['alpha']}, {info['modules']} modules (layer-20 FFN "
                     f"+ layers 21..39 in the release's numbering), path hash {info['hash']}.")
    if m.get("answers"):
        pairs = m["answers"]["pairs"]
        lines += ["", f"Each adapter is first trained on its domain text ({m['settings']['adapter_steps']} steps), "
                  "then fine-tuned from there on request -> answer pairs (`build_engines/training/answer_pairs.py`: "
                  f"{sum(d['train_pairs'] for d in pairs['domains'].values())} pairs, "
                  f"{m['settings'].get('answer_steps')} steps per adapter, each batch mixing pairs and the adapter's "
                  "own domain text; rank and size unchanged). How the pairs are made and kept apart from the held-out "
                  "requests: `manifest.json` -> `answers`."]
    if m.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in m["notes"]]
    kept = _kept_sections(args.out)
    args.out.write_text("\n".join(lines) + "\n" + kept)
    print("\n".join(lines))


def _structured_line(m: dict) -> str:
    """The structured-replies stage (build_engines/training/structured_stage.py), when the build ran it."""
    record = m.get("structured")
    if not record:
        return ""
    tokens = sum(record.get("tokens", {}).values())
    return (f" Then {record['steps']} steps of continued training of the decoder only (embedding and encoder frozen, "
            f"so H19 and routing are unchanged), {record['share']:.0%} of each batch from structured data "
            f"(`structured_data.py`: {tokens / 1e6:.2f} M tokens of JSON records from random schemas, tool-use "
            "conversations, chit-chat with tools offered, JSON in code and CSS; seed "
            f"{record['seed']}); each adapter mixes {record['adapters']['share']:.0%} of its batches from the kinds "
            f"of its domain (the agent adapter {record['adapters']['agent_share']:.0%}, tool use first).")


def _drafter_lines(m: dict) -> list[str]:
    """The DSpark drafter's section from the manifest's drafter record (written by the drafter stage)."""
    d = m.get("drafter")
    if not d:
        return []
    spec, train, data = d["spec"], d["training"], d["data"]
    acceptance = d["evaluation"]["acceptance"]
    trained = [row["trained"] for row in acceptance.values()]
    ngram = [row["ngram"] for row in acceptance.values()]
    block = spec["dspark_block_size"]
    layers = spec["dspark_target_layer_ids"]
    return [
        "## DSpark drafter (`drafter/`)",
        f"- {d['parameters'] / 1e6:.2f} M parameters in bf16 ({d['bytes'] / 1e6:.1f} MB): {spec['n_mtp_layers']} "
        f"stages, block {block}, target layers {layers[0]}-{layers[-1]}, Markov "
        f"rank {spec['dspark_markov_rank']}, {spec['dspark_n_routed_experts']} routed experts "
        f"top-{spec['dspark_n_activated_experts']} (`DSparkSpec.scaled`).",
        f"- Self-distilled by `{d['command']}` (also the last stage of `build_default`, `--drafter-steps`) from the "
        f"model's own greedy replies under the base and each adapter: {data['train']['sequences']:,} replies of at "
        f"most {data['settings']['max_new']} tokens, {train['steps']:,} steps of {train['batch']} anchors; "
        f"{d['timings_s']['wall_s'] / 60:.1f} min on {d['machine']['cpu_threads']} cores.",
        f"- Held-out acceptance: {sum(trained) / len(trained):.2f} of {block} drafts per block on average "
        f"({min(trained):.2f}-{max(trained):.2f} by adapter), against {sum(ngram) / len(ngram):.2f} for prompt "
        "lookup; details in [speculative.md](speculative.md) and the manifest's `drafter` record.",
        "",
    ]


# Sections other scripts write into the model card (they measure, this script only formats the manifest).
KEPT_SECTIONS = ("## Replies to requests", "## Structured replies", "## Before and after")


def _kept_sections(path: Path) -> str:
    """The sections of the current card written by other scripts (benchmarks/answer_eval.py), to re-append as they
    are."""
    if not path.exists():
        return ""
    text, out = path.read_text(), []
    for heading in KEPT_SECTIONS:
        start = text.find("\n" + heading)
        if start >= 0:
            end = text.find("\n## ", start + 1)
            out.append(text[start: end if end >= 0 else len(text)].rstrip() + "\n")
    return "".join(out)


if __name__ == "__main__":
    main()
