"""Aggregate decode throughput through a real tritonserver at 1, 4, 16 and 32 concurrent sessions, in one run.

    .venv/bin/python scripts/bench_serving.py [--sessions 1 4 16 32] [--tokens 64] [--rounds 2] [--out docs/load.md]

Each session is its own gRPC stream (tritonclient) holding a two-turn conversation; every turn asks for `--tokens`
tokens with greedy decoding and `ignore`-free stopping (max_tokens only, so every session decodes the same count).
Throughput = generated tokens / wall time from the first request to the last final response, per concurrency level;
levels are measured in interleaved rounds on one server and the median round is reported, with its ratio to one
session. Every session's replies are checked against the same session run alone (greedy outputs must be identical).
Writes the table into the "Throughput" section of docs/load.md (the rest of the file is kept).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from build_engines.build.cli import main as build_engines  # noqa: E402
from tritonserver_backend.client import GrpcChat, TurnRequest  # noqa: E402
from tritonserver_backend.launcher import TritonServer  # noqa: E402
from tritonserver_backend.repository import build_repository  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from doc_sections import write_section  # noqa: E402

MODEL = ROOT / "embedded" / "mol2-small"
ENGINES = ROOT / "artifacts" / "engines" / "mol2-small"
PROMPTS = ["Tell me about your weekend plans.", "def area(r):\n    return 3.14 * r * r", "How do I center a div with flexbox?",
           "grep -rn pattern . | head", "What is a good name for a cat?", "Explain list comprehensions in Python."]
SECTION = "## Throughput (scripts/bench_serving.py)"


def conversation(chat: GrpcChat, sid: str, index: int, tokens: int) -> list[list[int]]:
    replies = []
    for turn in range(2):
        text = PROMPTS[(index + turn) % len(PROMPTS)] + f" (session {index}, turn {turn})"
        reply = chat.turn(TurnRequest(sid, text, new_session=turn == 0, max_tokens=tokens, end_session=turn == 1), timeout=600)
        if reply.error:
            raise RuntimeError(f"{sid}: {reply.error}")
        replies.append(reply.token_ids)
    return replies


def run_level(url: str, sessions: int, tokens: int, tag: str, first: int = 0) -> tuple[float, int, dict[int, list[list[int]]]]:
    """`sessions` concurrent conversations (numbered first, first + 1, ...) -> wall time, tokens, replies by number."""
    chats = [GrpcChat(url) for _ in range(sessions)]
    results: dict[int, list[list[int]]] = {}
    errors: list[str] = []
    barrier = threading.Barrier(sessions + 1)

    def client(i: int) -> None:
        barrier.wait()
        try:
            results[first + i] = conversation(chats[i], f"{tag}-{first + i}", first + i, tokens)
        except Exception as exc:  # noqa: BLE001
            errors.append(str(exc))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(sessions)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for chat in chats:
        chat.close()
    if errors:
        raise RuntimeError(f"{len(errors)} sessions failed: {errors[:3]}")
    generated = sum(len(r) for replies in results.values() for r in replies)
    return wall, generated, results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--backend", default="onnx")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "load.md")
    p.add_argument("--work", type=Path, default=ROOT / "artifacts" / "bench_serving")
    args = p.parse_args()
    if build_engines(["--model", str(MODEL), "--out", str(ENGINES)]) != 0:
        return 1
    params = {"model_dir": str(MODEL), "registry_root": str(args.work / "registry"), "engine_backend": args.backend,
              "engine_dir": str(ENGINES), "max_active_turns": str(max(args.sessions)), "max_queued_turns": str(max(args.sessions))}
    repo = build_repository(args.work / "repo", params)
    server = TritonServer(work_dir=args.work / "server")
    server.start(repo)
    rows = []
    try:
        print(f"server ready after {server.wait_ready(300):.1f} s", flush=True)
        solo = {}  # every session alone first: the greedy reference
        for i in range(max(args.sessions)):
            solo.update(run_level(server.grpc_url, 1, args.tokens, "solo", first=i)[2])
        measured: dict[int, list[tuple[float, int]]] = {n: [] for n in args.sessions}
        for r in range(args.rounds):
            for n in args.sessions:
                wall, generated, results = run_level(server.grpc_url, n, args.tokens, f"r{r}n{n}")
                for i, replies in results.items():
                    if replies != solo[i]:
                        raise RuntimeError(f"session {i} at {n} concurrent sessions differs from its solo run")
                measured[n].append((wall, generated))
                print(f"round {r + 1}: {n:3d} sessions: {generated} tokens in {wall:.2f} s = {generated / wall:.1f} tokens/s", flush=True)
        base = statistics.median(g / w for w, g in measured[args.sessions[0]])
        for n in args.sessions:
            rates = [g / w for w, g in measured[n]]
            rate = statistics.median(rates)
            rows.append((n, rate, rate / base, rates))
    finally:
        server.stop()
    table = [SECTION, "",
             f"`.venv/bin/python scripts/bench_serving.py --sessions {' '.join(map(str, args.sessions))} --tokens {args.tokens} "
             f"--rounds {args.rounds} --backend {args.backend}` ({time.strftime('%Y-%m-%d')}): each session a gRPC stream with two "
             f"turns of {args.tokens} greedy tokens; aggregate decode tokens/s (all generated tokens / wall time), median of the "
             "rounds; every session's replies equal its solo run (checked).", "",
             "| concurrent sessions | tokens/s (median) | x one session | rounds |", "|---|---|---|---|"]
    for n, rate, ratio, rates in rows:
        table.append(f"| {n} | {rate:.1f} | {ratio:.2f} | {', '.join(f'{x:.1f}' for x in rates)} |")
    write_section(args.out, "\n".join(table) + "\n", SECTION)
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
