"""Speculative vs plain decoding through one real tritonserver, single stream and 16 sessions, in one run.

    .venv/bin/python -m benchmarks speculative [--drafters dspark ngram] [--sessions 1 16] [--tokens 64]
        [--rounds 5] [--block 4] [--draft-batches 8 32] [--out docs/speculative.md]

One server per drafter (`speculative=dspark`: the model's DSpark drafter in the engines; `ngram`: prompt lookup over
the reply) and `--draft-batches` value (the most turns a step may have going and still draft), one after the other.
A request with `speculative` false opts out, so plain and speculative turns are measured on the same server and
engines, in interleaved rounds (plain, then speculative, at each level). Each session is a thread with its own gRPC
stream (tritonclient), holding a two-turn conversation whose turns ask for `--tokens` greedy tokens under an explicit
adapter: session i of round r takes adapter (i + r) mod 5 (base, L0_chat .. L3_design), so over five rounds the single
stream visits every adapter. Per level and mode: aggregate decode tokens/s (tokens after each turn's first, over the
time in which at least one turn was decoding) and end-to-end tokens/s; medians over the rounds and the speculative /
plain ratio. Every speculative reply must equal its plain reply (greedy: token for token), or the run fails. From the
decoder's metrics: blocks verified, tokens drafted and accepted per adapter, and the mean tokens a drafting step gave.
Writes its section of `--out` (the rest of the file is kept).
"""

from __future__ import annotations

import argparse
import statistics
import time
import urllib.request
from pathlib import Path

from benchmarks.concurrent_clients import run_together
from benchmarks.harness import ROOT, default_params, ensure_engines, served, write_section
from benchmarks.serving import PROMPTS, decode_rate
from tritonserver_backend.clients.client import GrpcChat, TurnRequest

SECTION = "## Benchmark (benchmarks/speculative.py)"
COUNTERS = ("speculative_blocks", "speculative_drafted_tokens", "speculative_accepted_tokens")


ADAPTERS = ("base", "L0_chat", "L1_agent", "L2_code", "L3_design")


def conversation(chat: GrpcChat, sid: str, index: int, tokens: int, speculative: bool, adapter: str,
                 windows: list[tuple[float, float, int]]) -> list[list[int]]:
    replies = []
    for turn in range(2):
        text = PROMPTS[(index + turn) % len(PROMPTS)] + f" (session {index}, turn {turn})"
        stamps: list[float] = []
        reply = chat.turn(TurnRequest(sid, text, new_session=turn == 0, adapter=adapter, max_tokens=tokens,
                                      end_session=turn == 1, speculative=speculative),
                          timeout=600, on_piece=lambda _: stamps.append(time.perf_counter()))
        if reply.error:
            raise RuntimeError(f"{sid}: {reply.error}")
        if len(stamps) > 1:
            windows.append((stamps[0], stamps[-1], len(reply.token_ids) - 1))
        replies.append(reply.token_ids)
    return replies


def run_level(url: str, sessions: int, tokens: int, speculative: bool, tag: str,
              shift: int) -> tuple[float, float, dict[int, list[list[int]]]]:
    """`sessions` conversations at once -> (decode tokens/s, end-to-end tokens/s, replies by session)."""
    windows: list[tuple[float, float, int]] = []
    chats = [GrpcChat(url) for _ in range(sessions)]
    try:
        wall, out = run_together(sessions, lambda i: conversation(chats[i], f"{tag}-{i}", i, tokens, speculative,
                                                                  ADAPTERS[(i + shift) % len(ADAPTERS)], windows), tag)
    finally:
        for chat in chats:
            chat.close()
    generated = sum(len(r) for replies in out.values() for r in replies)
    return decode_rate(windows), generated / wall, out


def counters(metrics_url: str) -> dict[str, dict[str, float]]:
    """The decoder's speculative counters by adapter, from the metrics port."""
    values: dict[str, dict[str, float]] = {c: {} for c in COUNTERS}
    for line in urllib.request.urlopen(metrics_url).read().decode().splitlines():
        for name in COUNTERS:
            if line.startswith(f"mol2_{name}{{"):
                adapter = line.split('adapter="', 1)[1].split('"', 1)[0]
                values[name][adapter] = float(line.rsplit(" ", 1)[1])
    return values


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafters", nargs="+", default=["dspark", "ngram"],
                   help="the server's speculative (one server each)")
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 16])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--block", type=int, default=4, help="drafts per step (the server's speculative_block)")
    p.add_argument("--confidence", type=float, default=0.0,
                   help="the server's speculative_confidence (DSpark's block cut)")
    p.add_argument("--draft-batches", type=int, nargs="+", default=[8, 32],
                   help="the server's speculative_batch: most turns a step may have going and still draft (one server "
                   "each)")
    p.add_argument("--work", type=Path, default=ROOT / "build" / "bench_speculative")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    ensure_engines()
    measured: dict[tuple[str, int, int, bool], list[tuple[float, float]]] = {}
    delta: dict[str, dict[str, dict[str, float]]] = {d: {c: {} for c in COUNTERS} for d in args.drafters}
    servers = [(drafter, batch) for drafter in args.drafters for batch in args.draft_batches]
    for drafter, batch in servers:
        params = default_params(registry_root=str(args.work / "registry"), max_active_turns=str(max(args.sessions)),
                                max_queued_turns=str(max(args.sessions)), speculative=drafter,
                                speculative_block=str(args.block), speculative_batch=str(batch),
                                speculative_confidence=str(args.confidence))
        with served(args.work / f"{drafter}{batch}", params) as server:
            print(f"{drafter}, speculative_batch {batch}: server ready after {server.ready_seconds:.1f} s",
                  flush=True)
            before = counters(server.metrics_url)
            for r in range(args.rounds):
                for n in args.sessions:
                    replies = {}
                    for speculative in (False, True):
                        tag = f"{drafter}{batch}r{r}n{n}{'s' if speculative else 'p'}"
                        decode, e2e, replies[speculative] = run_level(server.grpc_url, n, args.tokens,
                                                                      speculative, tag, r)
                        measured.setdefault((drafter, batch, n, speculative), []).append((decode, e2e))
                        print(f"{drafter}, speculative_batch {batch}, round {r + 1}: {n:3d} sessions, "
                              f"{'speculative' if speculative else 'plain      '}: {decode:7.1f} decode tokens/s, "
                              f"{e2e:7.1f} end-to-end tokens/s", flush=True)
                    if replies[True] != replies[False]:
                        raise RuntimeError(f"{n} sessions, round {r + 1}: speculative replies differ from plain ones")
            after = counters(server.metrics_url)
        for c in COUNTERS:
            for a in after[c]:
                delta[drafter][c][a] = delta[drafter][c].get(a, 0.0) + after[c][a] - before[c].get(a, 0.0)
    lines = [SECTION, "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on this machine (2 CPU cores, no GPU) by "
             f"`benchmarks/speculative.py --drafters {' '.join(args.drafters)} --sessions "
             f"{' '.join(map(str, args.sessions))} --tokens {args.tokens} --rounds {args.rounds} --block {args.block} "
             f"--confidence {args.confidence} --draft-batches {' '.join(map(str, args.draft_batches))}`: a "
             "tritonserver per drafter and `speculative_batch` (onnx engines of the embedded default), plain turns "
             "opting out with `speculative` false, in interleaved rounds; medians over the rounds. Every speculative "
             "reply equalled its plain reply token for token.", "",
             "| drafter | speculative_batch | sessions | plain decode tok/s | speculative decode tok/s | ratio | plain "
             "end-to-end tok/s | speculative end-to-end tok/s | ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for drafter, batch in servers:
        for n in args.sessions:
            plain = [statistics.median(v[i] for v in measured[(drafter, batch, n, False)]) for i in (0, 1)]
            spec = [statistics.median(v[i] for v in measured[(drafter, batch, n, True)]) for i in (0, 1)]
            lines.append(f"| {drafter} | {batch} | {n} | {plain[0]:.1f} | {spec[0]:.1f} | {spec[0] / plain[0]:.2f}x | "
                         f"{plain[1]:.1f} | {spec[1]:.1f} | {spec[1] / plain[1]:.2f}x |")
    lines += ["",
              "Drafting per drafter and adapter (`accepted / blocks + 1` is the tokens a drafting step gave a turn):",
              "", "| drafter | adapter | blocks | drafted | accepted | accepted per draft | tokens per drafting step |",
              "|---|---|---|---|---|---|---|"]
    for drafter in args.drafters:
        for adapter in sorted(delta[drafter]["speculative_blocks"]):
            blocks, drafted, accepted = (delta[drafter][c].get(adapter, 0.0) for c in COUNTERS)
            if blocks:
                lines.append(f"| {drafter} | {adapter} | {blocks:.0f} | {drafted:.0f} | {accepted:.0f} | "
                             f"{accepted / max(drafted, 1):.2f} | {accepted / blocks + 1:.2f} |")
    section = "\n".join(lines) + "\n"
    print(section)
    if args.out:
        write_section(args.out, section, SECTION, "# Speculative decoding")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
