"""Speculative vs plain decoding through a Dynamo deployment (Dynamo's OpenAI frontend, encoder and decoder workers),
single stream, in one run.

    .venv/bin/python -m benchmarks speculative-dynamo [--setups dspark:1 ngram:2] [--tokens 64] [--rounds 5]
        [--out docs/speculative.md]

One deployment per setup `DRAFTER:TP` (1 encoder + 1 decoder worker; TP > 1: each worker leads that many torch
ranks), one after the other. A turn with the `nvext.annotations` entry `mol2-speculative:off` opts out, so plain and
speculative turns are measured on the same deployment, in interleaved rounds (plain, then speculative). Each round
holds a two-turn conversation per mode through the frontend's streamed chat completions (plain HTTP), under an
explicit adapter: round r takes adapter r mod 5 (base, L0_chat .. L3_design), after one unmeasured warm-up
conversation per mode. Per mode: decode tokens/s (the
streamed tokens after each turn's first, over the time between its first and last) and end-to-end tokens/s; medians
over the rounds and the speculative / plain ratio. Every speculative reply must equal its plain reply token for token
(the decoder's record in turns.jsonl), or the run fails. The decoder workers' counters give the blocks verified,
tokens drafted and accepted. Writes its section of `--out` (the rest of the file is kept).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from pathlib import Path

from benchmarks.harness import ROOT, ensure_engines, write_section
from benchmarks.serving import PROMPTS
from dynamo_deploy.client import stream_chat
from dynamo_deploy.launcher import Deployment, counter_totals, read_turns
from dynamo_deploy.model_ids import model_id
from dynamo_deploy.requests import SPECULATIVE_OFF
from tritonserver_backend.core.counters import DRAFTED, DRAFTS_ACCEPTED, SPECULATIVE_BLOCKS

SECTION = "## Benchmark through Dynamo (benchmarks/speculative_dynamo.py)"
ADAPTERS = ("base", "L0_chat", "L1_agent", "L2_code", "L3_design")
COUNTERS = (SPECULATIVE_BLOCKS, DRAFTED, DRAFTS_ACCEPTED)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def streamed_turn(url: str, model: str, messages: list[dict], tokens: int, speculative: bool,
                  ) -> tuple[str, list[float]]:
    """One streamed greedy chat turn -> (its text, the arrival time of each content chunk)."""
    body = {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0.0,
            "nvext": {"annotations": [] if speculative else [SPECULATIVE_OFF]}}
    text, stamps = [], []
    for event in stream_chat(url, body, timeout_s=600):
        for choice in event.get("choices", []):
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                text.append(piece)
                stamps.append(time.perf_counter())
    return "".join(text), stamps


def conversation(url: str, adapter: str, tokens: int, speculative: bool, round_index: int,
                 ) -> tuple[float, float, int]:
    """Two turns -> (decode seconds, end-to-end seconds, streamed chunks after each turn's first + first chunks)."""
    messages: list[dict] = []
    decode_s = e2e_s = 0.0
    chunks = 0
    for turn in range(2):
        messages.append({"role": "user", "content": f"{PROMPTS[(round_index + turn) % len(PROMPTS)]} (turn {turn})"})
        t0 = time.perf_counter()
        text, stamps = streamed_turn(url, model_id(adapter), messages, tokens, speculative)
        messages.append({"role": "assistant", "content": text})
        if len(stamps) > 1:
            decode_s += stamps[-1] - stamps[0]
        e2e_s += (stamps[-1] if stamps else time.perf_counter()) - t0
        chunks += len(stamps)
    return decode_s, e2e_s, chunks


def run_setup(work: Path, drafter: str, tp: int, tokens: int, rounds: int) -> dict[str, object]:
    d = Deployment(work / f"{drafter}-tp{tp}", ROOT / "embedded" / "mol2-small",
                   ROOT / "artifacts" / "engines" / "mol2-small", http_port=free_port(),
                   backend="torch" if tp > 1 else "onnx", tensor_parallel_size=tp, speculative=drafter)
    t0 = time.monotonic()
    d.start()
    print(f"{drafter}, TP={tp}: deployment ready after {time.monotonic() - t0:.1f} s", flush=True)
    rates: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    try:
        for speculative in (False, True):  # warm-up, not measured: a rank group starts on its first step
            conversation(d.url, ADAPTERS[0], tokens, speculative, len(PROMPTS) - 1)
        for r in range(rounds):
            adapter = ADAPTERS[r % len(ADAPTERS)]
            seen = len(read_turns(d.run_dir))
            replies = {}
            for speculative in (False, True):
                decode_s, e2e_s, chunks = conversation(d.url, adapter, tokens, speculative, r)
                turns = read_turns(d.run_dir)[seen:]
                seen += len(turns)
                replies[speculative] = [t["tokens"] for t in turns]
                generated = sum(len(t) for t in replies[speculative])
                # decode: tokens after each turn's first, over the time between the turn's first and last chunk
                rates[speculative].append(((generated - 2) / decode_s, generated / e2e_s))
                print(f"{drafter}, TP={tp}, round {r + 1} ({adapter}): "
                      f"{'speculative' if speculative else 'plain      '} {rates[speculative][-1][0]:7.1f} decode "
                      f"tokens/s, {rates[speculative][-1][1]:7.1f} end-to-end tokens/s ({chunks} chunks)", flush=True)
            if replies[True] != replies[False]:
                raise RuntimeError(f"{drafter}, TP={tp}, round {r + 1}: speculative replies differ from plain ones")
        counts = counter_totals([w for w in d.stats().values() if w["role"] == "decoder"], COUNTERS)
    finally:
        d.stop()
    return {"rates": rates, "counts": counts}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setups", nargs="+", default=["dspark:1", "ngram:1", "dspark:2", "ngram:2"],
                   help="DRAFTER:TP, one deployment each (TP > 1: the decoder's ranks return DSpark's rows, its "
                        "leader drafts)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--work", type=Path, default=ROOT / "build" / "bench_speculative_dynamo")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    ensure_engines()
    setups = [(s.split(":")[0], int(s.split(":")[1])) for s in args.setups]
    results = {s: run_setup(args.work, s[0], s[1], args.tokens, args.rounds) for s in setups}
    lines = [SECTION, "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on this machine (2 CPU cores, no GPU) by "
             f"`python -m benchmarks speculative-dynamo --setups {' '.join(args.setups)} --tokens {args.tokens} "
             f"--rounds {args.rounds}`: one Dynamo deployment per setup (Dynamo's frontend, 1 encoder + 1 decoder "
             "worker; TP > 1 on the torch backend, each worker leading its ranks), single stream, two-turn "
             "conversations under an explicit adapter, plain turns opting out with `mol2-speculative:off`, in "
             "interleaved rounds after one warm-up conversation per mode; medians over the rounds; the decoder's "
             "counters over the whole run, warm-up included. Every speculative reply equalled its plain reply token "
             "for token.", "",
             "| drafter | TP | plain decode tok/s | speculative decode tok/s | ratio | plain end-to-end tok/s | "
             "speculative end-to-end tok/s | ratio | blocks | drafted | accepted | tokens per drafting step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (drafter, tp), res in results.items():
        rates, counts = res["rates"], res["counts"]
        plain = [statistics.median(v[i] for v in rates[False]) for i in (0, 1)]  # type: ignore[index]
        spec = [statistics.median(v[i] for v in rates[True]) for i in (0, 1)]  # type: ignore[index]
        blocks, drafted, accepted = (counts[c] for c in COUNTERS)  # type: ignore[index]
        per_step = f"{accepted / blocks + 1:.2f}" if blocks else "-"
        lines.append(f"| {drafter} | {tp} | {plain[0]:.1f} | {spec[0]:.1f} | {spec[0] / plain[0]:.2f}x | "
                     f"{plain[1]:.1f} | {spec[1]:.1f} | {spec[1] / plain[1]:.2f}x | {blocks:.0f} | {drafted:.0f} | "
                     f"{accepted:.0f} | {per_step} |")
    section = "\n".join(lines) + "\n"
    print(section)
    if args.out:
        write_section(args.out, section, SECTION, "# Speculative decoding")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
