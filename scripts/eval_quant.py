"""fp32 vs bf16 vs fp8 vs int8 engines in one run: per-domain perplexity, engine bytes, decode tokens/s -> docs/quantization.md.

    .venv/bin/python scripts/eval_quant.py            # builds (or reuses) the fp8/int8 engines of the embedded default

Perplexity: held-out `test` text (prepared corpora when present, else the committed sample), base model on base text
and each adapter on its own domain, teacher-forced through the engine graphs (`build_engines/quantize/scoring.py`).
bf16: onnxruntime's CPU provider has no bf16 MatMul, so the bf16 row is the fp32 graph with every weight rounded to
bf16 (fp32 compute): its accuracy, not its speed or size. nvfp4 needs a GPU and is not in this run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from build_engines.build.cli import main as build  # noqa: E402
from build_engines.build.onnx_build import GRAPH_FILES, ort_runner  # noqa: E402
from build_engines.export.layout import StepLayout  # noqa: E402
from build_engines.export.rows import (  # noqa: E402
    HANDOVER_FIELDS,
    HANDOVER_KEYS,
    DecoderRow,
    EncoderRow,
    absorb_decoder,
    absorb_encoder,
    decoder_inputs,
    encoder_inputs,
)
from build_engines.formats.checkpoint import load_config  # noqa: E402
from build_engines.quantize.heldout import load_heldout, token_sequences  # noqa: E402
from build_engines.quantize.scoring import bundled_adapters, perplexity  # noqa: E402
from scripts.doc_sections import write_section  # noqa: E402

MODES = ("fp32", "bf16", "fp8", "int8")


def bf16_graph(src: Path, dst: Path) -> None:
    """The fp32 graph with every weight (float initializer of >= 2 dims) rounded to bf16 and stored back as fp32."""
    model = onnx.load(str(src))
    for i, t in enumerate(model.graph.initializer):
        if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) >= 2:
            a = torch.from_numpy(numpy_helper.to_array(t).copy()).to(torch.bfloat16).float().numpy()
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(a, t.name))
    onnx.save(model, str(dst))


def decode_speed(layout: StepLayout, enc, dec, bank, tokens: list[int], steps: int) -> float:  # type: ignore[no-untyped-def]
    """Median ms of one decode token (encoder step + decoder step, one row) after a prefill of `tokens`."""
    ids = np.asarray(tokens, np.int64)[None]
    erow, drow = EncoderRow.empty(layout), DecoderRow.empty(layout)
    out = enc(encoder_inputs(layout, [erow], ids))
    absorb_encoder(layout, [erow], out, ids.shape[1])
    drow.absorb(layout, {k: out[k][0] for k in HANDOVER_KEYS})
    feed = {**decoder_inputs(layout, [drow], None, [0]), **bank}
    absorb_decoder([drow], dec(feed), feed, True, [0])
    token, times = int(ids[0, -1]), []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = enc(encoder_inputs(layout, [erow], np.array([[token]], np.int64)))
        absorb_encoder(layout, [erow], out, 1)
        row = {k: out[k][0] for k in HANDOVER_KEYS}
        drow.absorb(layout, row)
        feed = {**decoder_inputs(layout, [drow], [{k: row[k] for k in HANDOVER_FIELDS}], [0]), **bank}
        result = dec(feed)
        absorb_decoder([drow], result, feed, False, [0])
        token = int(result["logits"][0].argmax())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "embedded" / "mol2-small")
    p.add_argument("--engines", type=Path, default=ROOT / "artifacts" / "engines")
    p.add_argument("--data", type=Path, default=ROOT / "artifacts" / "data")
    p.add_argument("--sequences", type=int, default=4, help="per domain")
    p.add_argument("--length", type=int, default=256, help="tokens per sequence")
    p.add_argument("--decode", type=int, default=48, help="decode steps timed per engine")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "quantization.md")
    args = p.parse_args()
    t_start = time.time()
    fp32_dir = args.engines / args.model.name
    dirs = {"fp32": fp32_dir}
    assert build(["--model", str(args.model), "--out", str(fp32_dir)]) == 0
    for mode in ("fp8", "int8"):
        dirs[mode] = args.engines / f"{args.model.name}-{mode}"
        assert build(["--model", str(args.model), "--out", str(dirs[mode]), "--quant", mode, "--reuse-fp32", str(fp32_dir)]) == 0
    tmp = Path(tempfile.mkdtemp(prefix="bf16-"))
    for name in ("encoder", "decoder"):
        bf16_graph(fp32_dir / GRAPH_FILES[name], tmp / GRAPH_FILES[name])
    dirs["bf16"] = tmp
    layout = StepLayout(load_config(args.model))
    adapters = bundled_adapters(args.model, layout)
    test = load_heldout(args.model, "test", args.data if (args.data / "manifest.json").exists() else None)
    if (args.data / "manifest.json").exists() and test.origin.endswith(".jsonl"):  # prefer the full split when prepared
        from build_engines.quantize.heldout import HeldoutText, extract  # noqa: F401

        records = extract(args.data, "test", args.sequences * args.length * 8)
        texts: dict[str, list[str]] = {}
        for r in records:
            texts.setdefault(r["kind"], []).append(r["text"])
        test = HeldoutText("test", texts, {k: sorted({r["source"] for r in records if r["kind"] == k}) for k in texts},
                           f"{args.data} (test split)", "-")
    sequences = token_sequences(test, args.model / "tokenizer.json", args.length, args.sequences)
    ppl: dict[str, dict[str, float]] = {}
    speed: dict[str, float] = {}
    for mode in MODES:
        enc, dec = (ort_runner(dirs[mode] / GRAPH_FILES[n]) for n in ("encoder", "decoder"))
        for kind, seqs in sequences.items():
            slot = adapters.slot_of_kind.get(kind, 0)
            ppl.setdefault(f"{kind} / {adapters.name_of_slot[slot]}", {})[mode] = perplexity(layout, enc, dec, adapters.bank, seqs, slot)
        speed[mode] = decode_speed(layout, enc, dec, adapters.bank, sequences["base"][0][:64], args.decode)
        print(f"{mode}: {json.dumps({k: round(v[mode], 3) for k, v in ppl.items()})} decode {speed[mode]:.2f} ms/token", flush=True)
    sizes = {m: sum((dirs[m] / GRAPH_FILES[n]).stat().st_size for n in ("encoder", "decoder")) for m in MODES}
    manifests = {m: json.loads((dirs[m] / "manifest.json").read_text()) for m in ("fp8", "int8")}
    bound = {"fp8": 0.02, "int8": 0.03}
    rel = {m: max(abs(v[m] / v["fp32"] - 1) for v in ppl.values()) for m in ("bf16", "fp8", "int8")}
    lines = [
        f"Produced by `.venv/bin/python scripts/eval_quant.py --sequences {args.sequences} --length {args.length} --decode {args.decode}` "
        f"({time.strftime('%Y-%m-%d')}, {time.time() - t_start:.0f} s, onnxruntime CPU, 1 thread). Text: {test.origin}, "
        f"{args.sequences} x {args.length} tokens per domain ({', '.join(f'{k}: {v}' for k, v in test.sources.items())}).",
        "",
        "| domain / adapter | " + " | ".join(MODES) + " | fp8 vs fp32 | int8 vs fp32 |",
        "|---|" + "---|" * (len(MODES) + 2),
    ]
    for key, v in ppl.items():
        lines.append(f"| {key} | " + " | ".join(f"{v[m]:.3f}" for m in MODES)
                     + f" | {v['fp8'] / v['fp32'] - 1:+.2%} | {v['int8'] / v['fp32'] - 1:+.2%} |")
    lines += [
        "",
        "| engine | encoder + decoder bytes | decode ms/token | decode tokens/s | worst perplexity change | bound (issue #13) | holds |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in MODES:
        size = f"{sizes[m] / 1e6:.1f} MB" + (" (stored fp32)" if m == "bf16" else "")
        change = "-" if m == "fp32" else f"{rel[m]:.2%}"
        b = bound.get(m)
        lines.append(f"| {m} | {size} | {speed[m]:.2f} | {1e3 / speed[m]:.0f} | {change} | {f'{b:.0%}' if b else '-'} | "
                     f"{('yes' if rel[m] <= b else 'NO') if b else '-'} |")
    lines += ["", "Calibration (from the engines' manifests): " + "; ".join(
        f"{m}: {c['calibration']['sequences']} sequences x {c['calibration']['sequence_tokens']} tokens of {c['calibration']['origin']} "
        f"({c['calibration']['encoder_feeds']} encoder / {c['calibration']['decoder_feeds']} decoder feeds), weights quantized: "
        + ", ".join(f"{g} {r['element_types']}" for g, r in c["graphs"].items())
        for m, c in ((m, manifests[m]["quant"]) for m in ("fp8", "int8")))]
    heading = "## Measured: fp32 vs bf16 vs fp8 vs int8 (scripts/eval_quant.py)"
    write_section(args.out, heading + "\n\n" + "\n".join(lines) + "\n", heading, title="# Quantized engines")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
