"""fp32 vs bf16 vs fp8 vs int8 engines, with and without fp8 KV state, in one run: per-domain perplexity, engine
bytes, decode tokens/s, session state bytes -> docs/quantization.md.

    .venv/bin/python -m benchmarks quant-accuracy  # builds (or reuses) the fp8/int8 engines of the embedded default

Perplexity: held-out `test` text (prepared corpora when present, else the committed sample), base model on base text
and each adapter on its own domain, teacher-forced through the engine graphs (`build_engines/quantize/scoring.py`)
with the rows each engine is served with (fp8 rings and stores for the `--kv-quant fp8` engines).
bf16: onnxruntime's CPU provider has no bf16 MatMul, so the bf16 row is the fp32 graph with every weight rounded to
bf16 (fp32 compute): its accuracy, not its speed or size. fp8/int8 run with their manifest's session config (weight
DequantizeLinear folded at load) and, for comparison, without it ("DQ per step": the plain session, how they ran
before). nvfp4 needs a GPU and is not in this run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from benchmarks.harness import ROOT, refuse_to_overwrite, write_section
from build_engines.build.cli import main as build
from build_engines.build.onnx_build import GRAPH_FILES
from build_engines.quantize.heldout import load_heldout, token_sequences
from build_engines.quantize.scoring import bundled_adapters, perplexity
from ced.formats.checkpoint import load_config
from ced.steps.kv_state import kv_layout, kv_runner
from ced.steps.layout import StepLayout
from ced.steps.rows import (
    HANDOVER_FIELDS,
    HANDOVER_KEYS,
    absorb_encoder,
    decoder_inputs,
    encoder_inputs,
)
from ced.steps.step_loop import StepLoop, prefill_and_replay

BUILDS = {"fp8": ["--quant", "fp8"], "int8": ["--quant", "int8"], "fp8-kv8": ["--quant", "fp8", "--kv-quant", "fp8"],
          "int8-kv8": ["--quant", "int8", "--kv-quant", "fp8"]}
BOUND = {"fp8": 0.02, "int8": 0.03}  # issue #13, by weight format
CONTEXTS = (256, 1024, 4096)  # session state bytes measured at these context lengths
HEADING = "## Measured: fp32 vs bf16 vs fp8 vs int8, with and without fp8 KV (benchmarks/quant_accuracy.py)"


@dataclass
class Variant:
    """One column of the comparison: an engine directory run with a session config and the rows it is served with."""

    name: str
    directory: Path
    config: dict[str, str] | None
    layout: StepLayout
    weights: str  # fp32 | bf16 | fp8 | int8 (the bound that applies)


def bf16_graph(src: Path, dst: Path) -> None:
    """The fp32 graph with every weight (float initializer of >= 2 dims) rounded to bf16 and stored back as fp32."""
    model = onnx.load(str(src))
    for i, t in enumerate(model.graph.initializer):
        if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) >= 2:
            a = torch.from_numpy(numpy_helper.to_array(t).copy()).to(torch.bfloat16).float().numpy()
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(a, t.name))
    onnx.save(model, str(dst))


def decode_speed(layout: StepLayout, enc, dec, bank, tokens: list[int],  # type: ignore[no-untyped-def]
                 steps: int) -> float:
    """Median ms of one decode token (encoder step + decoder step, one row) after a prefill of `tokens`."""
    ids = np.asarray(tokens, np.int64)[None]
    loop = StepLoop(layout, enc, dec, [0], bank)
    loop.prefill(ids)
    loop.replay()
    token, times = int(ids[0, -1]), []
    for _ in range(steps):
        t0 = time.perf_counter()
        token = int(loop.next_token(np.array([token]))["logits"][0].argmax())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def session_bytes(v: Variant, bank: dict[str, np.ndarray], tokens: np.ndarray, chunk: int = 256) -> dict[str, int]:
    """State bytes one session holds after a prefill of `tokens` (in the services' 256-token chunks) and a bounded
    replay, as the session stores count them (`nbytes()`: allocated arrays, stores grown by doubling)."""
    enc, dec = (kv_runner(v.directory / GRAPH_FILES[n], v.config) for n in ("encoder", "decoder"))
    erow, drow = prefill_and_replay(v.layout, enc, dec, bank, tokens, chunk)
    kv = erow.rings.nbytes + sum(a.nbytes for a in erow.kv.values()) + drow.kv.nbytes + drow.rings.nbytes
    return {"kv": kv, "session": erow.nbytes() + drow.nbytes()}


def step_feeds(v: Variant, enc, dec, bank: dict[str, np.ndarray], tokens: np.ndarray,  # type: ignore[no-untyped-def]
               chunk: int = 256):
    """The encoder and decoder feeds of one decode step after a prefill of `tokens` and a replay (the step's state:
    rings and stores at that context length)."""
    erow, drow = prefill_and_replay(v.layout, enc, dec, bank, tokens, chunk)
    enc_feed = encoder_inputs(v.layout, [erow], tokens[-1:][None])
    out = enc(enc_feed)
    absorb_encoder(v.layout, [erow], out, 1)
    row = {k: out[k][0] for k in HANDOVER_KEYS}
    drow.absorb(v.layout, row)
    return enc_feed, {**decoder_inputs(v.layout, [drow], [{k: row[k] for k in HANDOVER_FIELDS}], [0]), **bank}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "embedded" / "mol2-small")
    p.add_argument("--engines", type=Path, default=ROOT / "artifacts" / "engines")
    p.add_argument("--data", type=Path, default=ROOT / "artifacts" / "data")
    p.add_argument("--sequences", type=int, default=4, help="per domain")
    p.add_argument("--length", type=int, default=256, help="tokens per sequence")
    p.add_argument("--decode", type=int, default=48, help="decode steps timed per engine and round")
    p.add_argument("--rounds", type=int, default=3,
                   help="speed rounds, engines interleaved (a shared machine's load shifts)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "quantization.md")
    p.add_argument("--force", action="store_true", help="overwrite the committed --out file (docs/quantization.md)")
    args = p.parse_args()
    refuse_to_overwrite([args.out], args.force, "--out FILE")
    torch.set_num_threads(1)
    t_start = time.time()
    fp32_dir = args.engines / args.model.name
    cfg = load_config(args.model)
    assert build(["--model", str(args.model), "--out", str(fp32_dir)]) == 0
    dirs = {}
    for name, flags in BUILDS.items():
        dirs[name] = args.engines / f"{args.model.name}-{name}"
        assert build(["--model", str(args.model), "--out", str(dirs[name]), *flags, "--reuse-fp32", str(fp32_dir)]) == 0
    tmp = Path(tempfile.mkdtemp(prefix="bf16-"))
    for name in ("encoder", "decoder"):
        bf16_graph(fp32_dir / GRAPH_FILES[name], tmp / GRAPH_FILES[name])
    manifests = {name: json.loads((d / "manifest.json").read_text()) for name, d in dirs.items()}
    plain = StepLayout(cfg)
    variants = [Variant("fp32", fp32_dir, None, plain, "fp32"), Variant("bf16", tmp, None, plain, "bf16")]
    for w in ("fp8", "int8"):
        config = manifests[w]["quant"].get("session_config")
        kv = f"{w}-kv8"
        variants += [Variant(w, dirs[w], config, plain, w), Variant(f"{w} DQ per step", dirs[w], None, plain, w),
                     Variant(f"{w} + fp8 KV", dirs[kv], manifests[kv]["quant"].get("session_config"),
                             kv_layout(cfg, manifests[kv]), w)]
    layout = plain
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
    runners = {}
    for v in variants:
        enc, dec = runners[v.name] = tuple(kv_runner(v.directory / GRAPH_FILES[n], v.config)
                                           for n in ("encoder", "decoder"))
        for kind, seqs in sequences.items():
            slot = adapters.slot_of_kind.get(kind, 0)
            ppl.setdefault(f"{kind} / {adapters.name_of_slot[slot]}", {})[v.name] = perplexity(
                v.layout, enc, dec, adapters.bank, seqs, slot)
        print(f"{v.name}: {json.dumps({k: round(x[v.name], 3) for k, x in ppl.items()})}", flush=True)
    rng = np.random.default_rng(0)
    per_round: dict[str, list[float]] = {v.name: [] for v in variants}
    for _ in range(args.rounds):  # every engine once per round, so a load change hits all of them
        for v in variants:
            per_round[v.name].append(decode_speed(v.layout, *runners[v.name], adapters.bank, sequences["base"][0][:64],
                                                  args.decode))
    speed = {name: statistics.median(times) for name, times in per_round.items()}
    # one decode step (encoder + decoder, one row) at short and long context: the fp8 KV engines dequantize their whole
    # stores every step, which grows with the context; min over interleaved rounds of the median of 15 runs
    feeds = {(v.name, n): step_feeds(v, *runners[v.name], adapters.bank, rng.integers(0, cfg.vocab_size, n))
             for v in variants for n in (CONTEXTS[0], CONTEXTS[-1])}
    step: dict[tuple[str, int], list[float]] = {key: [] for key in feeds}
    for _ in range(5):
        for (name, n), (ef, df) in feeds.items():
            enc, dec = runners[name]
            times = []
            for _ in range(15):
                t0 = time.perf_counter()
                enc(ef)
                dec(df)
                times.append(time.perf_counter() - t0)
            step[(name, n)].append(statistics.median(times) * 1e3)
    print("decode ms/token per round:", json.dumps({k: [round(t, 2) for t in x] for k, x in per_round.items()}),
          flush=True)
    memory = {}
    for v in (variants[0], variants[4]):  # fp32 state vs fp8 state (the fp8 + fp8 KV engine)
        for n in CONTEXTS:
            memory[(v.name, n)] = session_bytes(v, adapters.bank, rng.integers(0, cfg.vocab_size, n))
    sizes = {v.name: sum((v.directory / GRAPH_FILES[n]).stat().st_size for n in ("encoder", "decoder"))
             for v in variants}
    names = [v.name for v in variants]
    quantized = [v for v in variants if v.weights in BOUND]
    rel = {v.name: max(abs(x[v.name] / x["fp32"] - 1) for x in ppl.values()) for v in variants[1:]}
    lines = [
        f"Produced by `.venv/bin/python -m benchmarks quant-accuracy --sequences {args.sequences} "
        f"--length {args.length} "
        f"--decode {args.decode} --rounds {args.rounds}` ({time.strftime('%Y-%m-%d')}, {time.time() - t_start:.0f} s, "
        f"onnxruntime CPU, 1 thread; decode speed: median over {args.rounds} rounds, engines interleaved, of each "
        f"round's median step). Text: {test.origin}, {args.sequences} x {args.length} tokens per domain "
        f"({', '.join(f'{k}: {v}' for k, v in test.sources.items())}). `fp8`/`int8`: the engines as served (manifest "
        f"session config `{manifests['fp8']['quant'].get('session_config')}`: weight DequantizeLinear folded at load); "
        "`DQ per step`: the same files in a plain session; `+ fp8 KV`: built with `--kv-quant fp8`, served with fp8 "
        "rings and global-KV stores.",
        "",
        "| domain / adapter | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for key, x in ppl.items():
        lines.append(f"| {key} | " + " | ".join(f"{x[m]:.3f}" for m in names) + " |")
    lines += ["", "Change against fp32:", "", "| domain / adapter | " + " | ".join(v.name for v in quantized) + " |",
              "|---|" + "---|" * len(quantized)]
    for key, x in ppl.items():
        lines.append(f"| {key} | " + " | ".join(f"{x[v.name] / x['fp32'] - 1:+.2%}" for v in quantized) + " |")
    lines += [
        "",
        "| engine | encoder + decoder bytes | decode ms/token | decode tokens/s | worst perplexity change | bound | "
        "holds |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in variants:
        size = f"{sizes[v.name] / 1e6:.1f} MB" + (" (stored fp32)" if v.name == "bf16" else "")
        change = "-" if v.name == "fp32" else f"{rel[v.name]:.2%}"
        b = BOUND.get(v.weights)
        lines.append(f"| {v.name} | {size} | {speed[v.name]:.2f} | {1e3 / speed[v.name]:.0f} | {change} | "
                     f"{f'{b:.0%}' if b else '-'} | {('yes' if rel[v.name] <= b else 'NO') if b else '-'} |")
    lines += ["", "Decode ms/token per round: "
              + "; ".join(f"{k} {', '.join(f'{t:.2f}' for t in x)}" for k, x in per_round.items())]
    short, long = CONTEXTS[0], CONTEXTS[-1]
    lines += ["", f"One decode step (encoder + decoder step of one row, feeds prepared) at context {short} and {long}: "
              "min over 5 interleaved rounds of the median of 15 runs, ms (less sensitive to the shared machine's load "
              "than the decode loop above).", "",
              "| engine | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for n in (short, long):
        lines.append(f"| step at {n} | " + " | ".join(f"{min(step[(m, n)]):.2f}" for m in names) + " |")
    lines += ["", "Session state bytes (encoder row + decoder row after a prefill of N tokens in 256-token chunks and "
              "a bounded replay, as the session stores count them: allocated arrays, global-KV stores grown by "
              "doubling). \"rings + KV\" = window rings of both sides, every global-KV store and the decoder's mirror "
              "(what `--kv-quant fp8` stores in fp8); the rest is index keys, the pending pair and the last W "
              "hand-over rows (fp32 in both).", "",
              "| context N | rings + KV fp32 | rings + KV fp8 | ratio | whole session fp32 | whole session fp8 KV | "
              "ratio |",
              "|---|---|---|---|---|---|---|"]
    for n in CONTEXTS:
        a, b = memory[("fp32", n)], memory[(variants[4].name, n)]
        lines.append(f"| {n} | {a['kv']:,} | {b['kv']:,} | {a['kv'] / b['kv']:.2f}x | {a['session']:,} | "
                     f"{b['session']:,} | {a['session'] / b['session']:.2f}x |")
    lines += ["", "Calibration (from the engines' manifests): " + "; ".join(
        f"{m}: {c['calibration']['sequences']} sequences x {c['calibration']['sequence_tokens']} tokens of "
        f"{c['calibration']['origin']} ({c['calibration']['encoder_feeds']} encoder / "
        f"{c['calibration']['decoder_feeds']} decoder feeds), weights quantized: "
        + ", ".join(f"{g} {r['element_types']}" for g, r in c["graphs"].items())
        for m, c in ((m, manifests[m]["quant"]) for m in ("fp8", "int8")))]
    kv = manifests["fp8-kv8"]["quant"]["kv_cache"]
    lines += ["", "fp8 KV scales of the fp8 + fp8 KV engine (amax / 448 over the same calibration run): "
                  f"{json.dumps(kv['scales'])}"]
    write_section(args.out, HEADING + "\n\n" + "\n".join(lines) + "\n", HEADING, title="# Quantized engines")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
