"""Adapter switch cost vs context length: bounded replay vs a full hand-off, on the served engines, in one run.

    .venv/bin/python -m benchmarks switch [--lengths 1024 2048 4096 8192 16384] [--rounds 5] [--handoff-rounds 2]

A conversation of each length is prefilled once (random token ids, seeded: the work per position does not depend on
the text) and its history is decoded under a source adapter. Then, rounds interleaved over the lengths (the order
rotates each round):
- **bounded replay** (what this system does on a switch or a new turn): the decoder re-runs the last W = 128
  hand-over rows under the target adapter on fresh rings; the encoder state and the global KV are reused as they are;
- **full hand-off** (what a system whose every layer carries LoRA must do: its KV depends on the adapter): the
  whole context is prefilled again under the target, encoder and decoder, in the service's 256-token chunks.
Both run through the same engine runtime the server uses (`--backend onnx` by default). Printed and written to
`docs/benchmarks.md`: median and spread per length, positions recomputed, replay(16K)/replay(1K), hand-off/replay,
and a plot.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks.harness import (
    DEFAULT_ENGINES,
    EMBEDDED,
    ROOT,
    ensure_engines,
    refuse_to_overwrite,
    save_figure,
    write_section,
)
from ced.formats.checkpoint import load_checkpoint
from ced.lora import AdapterBank
from ced.steps.lora_stacked import stack_adapters
from ced.steps.step_loop import StepLoop
from tritonserver_backend.engines import open_engine

SECTION = "## Switch cost vs context length (benchmarks/switch.py)"
CHUNK = 256  # the encoder service's prefill chunk


def prefill(engine, tokens: np.ndarray, slot: int | None) -> StepLoop:  # type: ignore[no-untyped-def]
    """Encoder prefill of `tokens` in chunks; with a slot, the decoder runs every chunk too (a full hand-off)."""
    loop = StepLoop(engine.layout, engine.encoder, engine.decoder, [0 if slot is None else slot])
    for i in range(0, tokens.shape[1], CHUNK):
        rows = StepLoop.handovers(loop.encode(tokens[:, i:i + CHUNK]), 1)
        if slot is None:
            loop.hand_over(rows)
        else:
            loop.decode(rows)
    return loop


def replay(loop: StepLoop, slot: int) -> np.ndarray:
    """The session's bounded replay under `slot` (an adapter switch): the last position's logits."""
    loop.slots = [slot]
    return loop.replay()["logits"][0]


def spread(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--rounds", type=int, default=5, help="timed replays per length")
    p.add_argument("--handoff-rounds", type=int, default=2, help="timed full hand-offs per length")
    p.add_argument("--backend", default="onnx")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--force", action="store_true",
                   help="overwrite the committed --out file and its figure (docs/benchmarks.md, docs/figures/)")
    args = p.parse_args()
    refuse_to_overwrite([args.out, args.out.parent / "figures" / "switch_cost.png"], args.force, "--out FILE")
    ensure_engines()
    engine = open_engine(args.backend, EMBEDDED, DEFAULT_ENGINES)
    layout = engine.layout
    _, dec = load_checkpoint(EMBEDDED).split()
    adapters = AdapterBank(layout.cfg, dec).load_bundled(EMBEDDED)
    names = sorted(adapters)
    engine.set_lora_bank(stack_adapters(layout, [None, *[adapters[k] for k in names]]))
    source, target = 1, 3  # slots: names[0] wrote the history, names[2] takes over
    rng = np.random.default_rng(0)
    contexts, rows = {}, {}
    for length in tqdm(args.lengths, desc="prefill contexts"):
        contexts[length] = rng.integers(0, layout.cfg.vocab_size, (1, length))
        rows[length] = prefill(engine, contexts[length], None)
        replay(rows[length], source)  # the history's local state written by the source adapter
    replay_ms: dict[int, list[float]] = {n: [] for n in args.lengths}
    handoff_s: dict[int, list[float]] = {n: [] for n in args.lengths}
    total = args.rounds * len(args.lengths) + args.handoff_rounds * len(args.lengths)
    with tqdm(total=total, desc="timed switches") as bar:
        for r in range(max(args.rounds, args.handoff_rounds)):
            order = args.lengths[r % len(args.lengths):] + args.lengths[:r % len(args.lengths)]
            for length in order:
                if r < args.rounds:
                    t = time.perf_counter()
                    replay(rows[length], target)
                    replay_ms[length].append((time.perf_counter() - t) * 1e3)
                    replay(rows[length], source)  # back to the source for the next round
                    bar.update()
                if r < args.handoff_rounds:
                    t = time.perf_counter()
                    prefill(engine, contexts[length], target)
                    handoff_s[length].append(time.perf_counter() - t)
                    bar.update()
    text = render(args, engine.describe(), names[source - 1], names[target - 1], replay_ms, handoff_s)
    plot(args.out.parent / "figures" / "switch_cost.png", replay_ms, handoff_s)
    write_section(args.out, text, SECTION, title="# Benchmarks: the article's serving results, reproduced")
    print(text)
    return 0


def render(args, engine: str, source: str, target: str, replay_ms, handoff_s) -> str:  # type: ignore[no-untyped-def]
    first, last = args.lengths[0], args.lengths[-1]
    lines = [
        SECTION, "",
        f"Produced by `.venv/bin/python -m benchmarks switch --rounds {args.rounds} --handoff-rounds "
        f"{args.handoff_rounds}` ({time.strftime('%Y-%m-%d')}, engine {engine}, 1 thread, history written by "
        f"`{source}`, switch to `{target}`; lengths interleaved, the order rotating each round).", "",
        "| context tokens | bounded replay ms (median, spread) | positions recomputed | full hand-off s (median, "
        "spread) | positions recomputed | hand-off / replay |",
        "|---|---|---|---|---|---|",
    ]
    for n in args.lengths:
        rep, hand = statistics.median(replay_ms[n]), statistics.median(handoff_s[n])
        lines.append(f"| {n:,} | {rep:.1f} ({spread(replay_ms[n])}) | {min(n, 128)} rows, decoder layers only | "
                     f"{hand:.2f} ({min(handoff_s[n]):.2f}-{max(handoff_s[n]):.2f}) | {n:,} rows, every layer | "
                     f"{hand * 1e3 / rep:,.0f}x |")
    ratio = statistics.median(replay_ms[last]) / statistics.median(replay_ms[first])
    grow = statistics.median(handoff_s[last]) / statistics.median(handoff_s[first])
    lines += [
        "",
        f"- Replay at {last:,} / replay at {first:,}: **{ratio:.2f}x** (target: within 1.2x). Full hand-off at "
        f"{last:,} / at {first:,}: {grow:.1f}x; at {last:,} the hand-off costs "
        f"{statistics.median(handoff_s[last]) * 1e3 / statistics.median(replay_ms[last]):,.0f}x the replay.",
        "- What made replay grow with context before (measured on the same engines before commit 99e8832: 18.3 ms at "
        "1K, 25.7 ms at 4K, 55.7 ms at 16K): the decoder's re-index layer scored its queries against **every** stored "
        "index key and then masked all but layer 20's candidate blocks with a (rows x entries x blocks) comparison; "
        "onnxruntime's profile of a 16K replay showed that Equal node alone at 16.6 ms, its ReduceMax 6.6 ms and Cast "
        "4.9 ms. The step now gathers the candidate pool (8 blocks x 8 entries, ascending so ties still go to the "
        "lower entry) and scores only those: O(pool) per query, the same selection (the ONNX-vs-step and "
        "step-vs-reference parity tests pass unchanged).",
        "- The encoder side of a new turn still grows with context as the design says it should: its lightning "
        "indexers score all global entries (O(context) per new token, cheap per entry), and a switch does not run the "
        "encoder at all.",
        "",
        "![switch cost](figures/switch_cost.png)",
    ]
    return "\n".join(lines)


def plot(path: Path, replay_ms, handoff_s) -> None:  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted(replay_ms)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(lengths, [statistics.median(replay_ms[n]) for n in lengths], "o-", label="bounded replay (128 rows)")
    ax.plot(lengths, [statistics.median(handoff_s[n]) * 1e3 for n in lengths], "s-", label="full hand-off (re-prefill)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("switch time, ms")
    ax.set_title("Adapter switch cost vs context length")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
