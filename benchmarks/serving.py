"""Aggregate decode throughput through a real tritonserver at 1, 4, 16 and 32 concurrent sessions, in one run.

    .venv/bin/python -m benchmarks serving [--sessions 1 4 16 32] [--tokens 64] [--rounds 2] [--stream-intervals 1 4]
                                              [--lanes 1] [--threads 1] [--client asyncio|threads] [--out docs/load.md]

Each session is its own gRPC stream (tritonclient) holding a two-turn conversation; every turn asks for `--tokens`
greedy tokens (the small model rarely ends a turn by itself before that). By default one asyncio loop drives every
stream, which takes less of the server's 2 cores than a thread per session (`--client threads`). Per concurrency level:
aggregate decode tokens/s (tokens after each turn's first, over the time in which at least one turn was decoding: turn
starts are time to first token) and end-to-end tokens/s (all tokens over the wall time). Levels are measured in
interleaved rounds on one server and medians are reported with their ratio to one session. Every session's replies are
checked against the same session run alone (greedy outputs must be identical). With several `--stream-intervals` (the
decoder's `stream_interval`: tokens per streamed response), one server per interval is measured the same way, one after
the other, and each interval's ratios are to one session at that interval. Writes its section of docs/load.md (the rest
is kept).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

from benchmarks.concurrent_clients import run_together
from benchmarks.harness import (
    ROOT,
    default_params,
    ensure_engines,
    refuse_to_overwrite,
    served,
    write_section,
)
from tritonserver_backend.clients.client import AsyncGrpcChat, GrpcChat, TurnRequest

PROMPTS = ["Tell me about your weekend plans.", "def area(r):\n    return 3.14 * r * r",
           "How do I center a div with flexbox?", "grep -rn pattern . | head", "What is a good name for a cat?",
           "Explain list comprehensions in Python."]
SECTION = "## Throughput (benchmarks/serving.py)"


def _turn_request(sid: str, index: int, turn: int, tokens: int) -> TurnRequest:
    text = PROMPTS[(index + turn) % len(PROMPTS)] + f" (session {index}, turn {turn})"
    return TurnRequest(sid, text, new_session=turn == 0, max_tokens=tokens, end_session=turn == 1)


def _record(sid: str, reply, stamps: list[float],  # type: ignore[no-untyped-def]
            windows: list[tuple[float, float, int]], interval: int) -> list[int]:
    """A turn's decode window: first response's time, last response's time, tokens after the first response (which
    carries `interval` tokens)."""
    if reply.error:
        raise RuntimeError(f"{sid}: {reply.error}")
    if len(stamps) > 1:
        windows.append((stamps[0], stamps[-1], len(reply.token_ids) - min(interval, len(reply.token_ids))))
    return reply.token_ids


def conversation(chat: GrpcChat, sid: str, index: int, tokens: int, windows: list[tuple[float, float, int]],
                 interval: int = 1) -> list[list[int]]:
    """Two turns on a thread of their own; each turn's decode window is recorded."""
    replies = []
    for turn in range(2):
        stamps: list[float] = []
        reply = chat.turn(_turn_request(sid, index, turn, tokens), timeout=600,
                          on_piece=lambda _: stamps.append(time.perf_counter()))
        replies.append(_record(sid, reply, stamps, windows, interval))
    return replies


async def conversation_async(chat: AsyncGrpcChat, sid: str, index: int, tokens: int,
                             windows: list[tuple[float, float, int]], interval: int = 1) -> list[list[int]]:
    """The same two turns as a coroutine: every session of a level shares one event loop."""
    replies = []
    for turn in range(2):
        stamps: list[float] = []
        reply = await chat.turn(_turn_request(sid, index, turn, tokens),
                                on_piece=lambda _: stamps.append(time.perf_counter()))
        replies.append(_record(sid, reply, stamps, windows, interval))
    return replies


def decode_rate(windows: list[tuple[float, float, int]]) -> float:
    """Decode tokens (all but each turn's first) per second of time in which at least one turn was decoding: the
    aggregate decode throughput, without the turn starts (prefill, routing, replay, which time to first token shows)."""
    spans = sorted((a, b) for a, b, _ in windows)
    covered, end = 0.0, float("-inf")
    for a, b in spans:
        if a > end:
            covered += b - a
            end = b
        elif b > end:
            covered += b - end
            end = b
    return sum(n for _, _, n in windows) / covered if covered > 0 else 0.0


def run_level(url: str, sessions: int, tokens: int, tag: str, first: int = 0, interval: int = 1,
              client: str = "asyncio") -> tuple[float, int, dict[int, list[list[int]]], float]:
    """`sessions` concurrent conversations (numbered first, first + 1, ...) -> wall time, tokens, replies by number,
    aggregate decode tokens/s. `client`: "asyncio" (one event loop, a stream per session: the lighter load generator)
    or "threads" (a thread and a stream per session)."""
    windows: list[tuple[float, float, int]] = []
    if client == "asyncio":
        wall, out = asyncio.run(_run_async(url, sessions, tokens, tag, first, interval, windows))
    else:
        chats = [GrpcChat(url) for _ in range(sessions)]
        try:
            wall, out = run_together(sessions, lambda i: conversation(chats[i], f"{tag}-{first + i}", first + i, tokens,
                                                                      windows, interval), tag)
        finally:
            for chat in chats:
                chat.close()
    results = {first + i: replies for i, replies in out.items()}
    generated = sum(len(r) for replies in results.values() for r in replies)
    return wall, generated, results, decode_rate(windows)


async def _run_async(url: str, sessions: int, tokens: int, tag: str, first: int, interval: int,
                     windows: list[tuple[float, float, int]]) -> tuple[float, dict[int, list[list[int]]]]:
    chats = [AsyncGrpcChat(url) for _ in range(sessions)]
    try:
        t0 = time.perf_counter()
        replies = await asyncio.gather(*(conversation_async(chats[i], f"{tag}-{first + i}", first + i, tokens,
                                                            windows, interval)
                                         for i in range(sessions)))
        return time.perf_counter() - t0, dict(enumerate(replies))
    finally:
        for chat in chats:
            await chat.close()


def measure_server(args: argparse.Namespace, interval: int) -> list[tuple]:
    """One server with this stream interval: every session alone first (the greedy reference), then the levels in
    interleaved rounds -> table rows."""
    params = default_params(registry_root=str(args.work / "registry"), engine_backend=args.backend,
                            max_active_turns=str(max(args.sessions)), max_queued_turns=str(max(args.sessions)),
                            stream_interval=str(interval), decode_lanes=str(args.lanes),
                            torch_threads=str(args.threads))
    rows = []
    with served(args.work, params) as server:
        print(f"stream_interval {interval}: server ready after {server.ready_seconds:.1f} s", flush=True)
        solo = {}
        for i in range(max(args.sessions)):
            solo.update(run_level(server.grpc_url, 1, args.tokens, f"solo{interval}", first=i, interval=interval,
                                  client=args.client)[2])
        measured: dict[int, list[tuple[float, float]]] = {n: [] for n in args.sessions}
        for r in range(args.rounds):
            for n in args.sessions:
                wall, generated, results, decode = run_level(server.grpc_url, n, args.tokens, f"i{interval}r{r}n{n}",
                                                             interval=interval, client=args.client)
                for i, replies in results.items():
                    if replies != solo[i]:
                        raise RuntimeError(f"session {i} at {n} concurrent sessions differs from its solo run")
                measured[n].append((decode, generated / wall))
                print(f"stream_interval {interval}, round {r + 1}: {n:3d} sessions: {generated} tokens in {wall:.2f} s "
                      f"= {generated / wall:.1f} tokens/s end to end, {decode:.1f} decode tokens/s", flush=True)
        base_decode = statistics.median(d for d, _ in measured[args.sessions[0]])
        base_e2e = statistics.median(e for _, e in measured[args.sessions[0]])
        for n in args.sessions:
            decode = statistics.median(d for d, _ in measured[n])
            e2e = statistics.median(e for _, e in measured[n])
            rows.append((interval, n, decode, decode / base_decode, e2e, e2e / base_e2e, measured[n]))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--backend", default="onnx")
    p.add_argument("--stream-intervals", type=int, nargs="+", default=[1],
                   help="the decoder's stream_interval, one server each")
    p.add_argument("--lanes", type=int, default=1, help="the decoder's decode_lanes")
    p.add_argument("--threads", type=int, default=1, help="the models' torch_threads (onnxruntime intra-op threads)")
    p.add_argument("--client", choices=("asyncio", "threads"), default="asyncio",
                   help="load generator: one asyncio loop with a gRPC stream per session (default), or a thread per "
                   "session")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "load.md")
    p.add_argument("--work", type=Path, default=ROOT / "artifacts" / "bench_serving")
    p.add_argument("--force", action="store_true", help="overwrite the committed --out file (docs/load.md)")
    args = p.parse_args()
    refuse_to_overwrite([args.out], args.force, "--out FILE")
    ensure_engines()
    rows = []
    for interval in args.stream_intervals:
        rows += measure_server(args, interval)
    table = [SECTION, "",
             f"`.venv/bin/python -m benchmarks serving --sessions {' '.join(map(str, args.sessions))} --tokens "
             f"{args.tokens} --rounds {args.rounds} --backend {args.backend} --stream-intervals "
             f"{' '.join(map(str, args.stream_intervals))} --lanes {args.lanes} --threads {args.threads} --client "
             f"{args.client}` ({time.strftime('%Y-%m-%d')}): each session a gRPC stream "
             f"({'every stream driven from one asyncio loop' if args.client == 'asyncio' else 'a client thread each'}) "
             f"with two turns of {args.tokens} greedy tokens, all sessions starting together. Aggregate decode "
             "tokens/s = tokens after each turn's first response / time during which at least one turn was decoding "
             "(turn starts excluded: prefill, routing and replay are time to first token); end to end = all tokens / "
             "wall time. Medians of the rounds; every session's replies equal its solo run (checked). Stream interval "
             "= the decoder's `stream_interval` (tokens per streamed response); each interval's ratios are to one "
             "session at that interval.", "",
             "| stream interval | concurrent sessions | decode tokens/s | x one session | end-to-end tokens/s | x one "
             "session | rounds (decode, end to end) |",
             "|---|---|---|---|---|---|---|"]
    for interval, n, decode, ratio, e2e, e2e_ratio, runs in rows:
        table.append(f"| {interval} | {n} | {decode:.1f} | {ratio:.2f} | {e2e:.1f} | {e2e_ratio:.2f} | "
                     f"{'; '.join(f'{d:.0f}, {e:.0f}' for d, e in runs)} |")
    write_section(args.out, "\n".join(table) + "\n", SECTION)
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
