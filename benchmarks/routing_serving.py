"""Serving throughput by where routing runs, through a real tritonserver: fixed route vs MoL2 in the engine vs routers
outside it, on one workload, setups interleaved in one run.

    .venv/bin/python -m benchmarks routing-serving [--sessions 8] [--turns 4] [--tokens 32] [--rounds 2]

Workload: `--sessions` concurrent gRPC streams, each a conversation of `--turns` turns whose domain changes every turn
(chat, code, web design, shell), `--tokens` greedy tokens a turn. Setups (the article's Table 10):
- **fixed route**: the client names the adapter. The names are the ones MoL2 chose for the same turns in an unmeasured
  calibration run, so the two setups decode exactly the same tokens (checked) and differ only in where the choice
  is made;
- **MoL2 in the engine**: no adapter on the request; the ensemble's router model reads H19 and the hash travels with
  the hand-over (the served default);
- **MoL2 outside the engine**: a routing pass as a second request before the answer: a router outside the serving
  engine must see the conversation, so it is a throw-away session rebuilt from `history` plus the new turn
  (max_tokens 1, ended at once), whose routed adapter the client then names on the real turn;
- **MoL outside the engine**: the same throw-away session plus a routing prompt, decoded by the chat adapter (up to
  24 label tokens, as the latency study's MoL); the number it writes picks the adapter (the chat adapter if none);
- **Contextual MoL outside the engine (cost stand-in)**: the throw-away session holds the conversation, the turn and
  the four adapter descriptions (Contextual MoL encodes the options after the query); its decision needs hidden
  states the server does not return, so the client names the adapter the pass routed to. Timing only.
Reported per setup: answer tokens/s over the wall time (routing requests' tokens are not counted), median time per
turn, wall time, and the change against the fixed route; medians over rounds. Written to `docs/benchmarks.md`.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from benchmarks.concurrent_clients import run_together
from benchmarks.harness import (
    EMBEDDED,
    ROOT,
    default_params,
    ensure_engines,
    refuse_to_overwrite,
    save_figure,
    served,
    write_section,
)
from tritonserver_backend.adapters.registry_init import description_of
from tritonserver_backend.clients.client import GrpcChat, Reply, TurnRequest

SECTION = "## Throughput by where routing runs (benchmarks/routing_serving.py)"
DOMAIN_TURNS = [
    "hey, how was your day? anything fun planned for the weekend?",
    "def merge(a, b):\n    out = []\n    while a and b:",
    "How do I make the navigation bar stick to the top with CSS?",
    "tar -xzvf archive.tar.gz -C /tmp  # what do these flags do?",
]
ADAPTERS = ["L0_chat", "L1_agent", "L2_code", "L3_design"]
MOL_PROMPT = ("Which assistant should answer the last message? 0 chat, 1 agent, 2 code, 3 design. Answer with the "
              "number.")
SETUPS = ["fixed route", "MoL2 in the engine", "MoL2 outside the engine", "MoL outside the engine",
          "Contextual MoL outside the engine (cost stand-in)"]

Router = Callable[[GrpcChat, str, list[dict[str, str]], str], str | None]


def text_of(session: int, turn: int) -> str:
    return f"{DOMAIN_TURNS[(session + turn) % len(DOMAIN_TURNS)]} (#{session}.{turn})"


def checked(reply: Reply, what: str) -> Reply:
    if reply.error:
        raise RuntimeError(f"{what}: {reply.error}")
    return reply


def side_pass(chat: GrpcChat, sid: str, history: list[dict[str, str]], text: str, adapter: str | None,
              tokens: int) -> Reply:
    """A throw-away session rebuilt from the conversation: what a router outside the serving engine has to run."""
    request = TurnRequest(f"{sid}-route-{time.monotonic_ns()}", text, new_session=True, adapter=adapter,
                          max_tokens=tokens, history=json.dumps(history), end_session=True)
    return checked(chat.turn(request, timeout=600), f"{sid} routing pass")


def mol2_outside(chat: GrpcChat, sid: str, history: list[dict[str, str]], text: str) -> str | None:
    return side_pass(chat, sid, history, text, None, 1).adapter


def mol_outside(chat: GrpcChat, sid: str, history: list[dict[str, str]], text: str) -> str | None:
    label = side_pass(chat, sid, history + [{"role": "user", "content": text}], MOL_PROMPT, ADAPTERS[0], 24).text
    found = re.search(r"[0-3]", label)
    return ADAPTERS[int(found.group())] if found else ADAPTERS[0]


def contextual_outside(descriptions: str) -> Router:
    def route(chat: GrpcChat, sid: str, history: list[dict[str, str]], text: str) -> str | None:
        return side_pass(chat, sid, history, f"{text}\n\nOptions:\n{descriptions}", None, 1).adapter
    return route


def conversation(chat: GrpcChat, sid: str, index: int, turns: int, tokens: int, fixed: list[str] | None,
                 router: Router | None, times: list[float]) -> tuple[list[list[int]], list[str], int]:
    """One conversation -> its replies' tokens, the adapter of each turn, answer tokens."""
    history: list[dict[str, str]] = []
    replies, adapters, generated = [], [], 0
    for turn in range(turns):
        text = text_of(index, turn)
        t = time.perf_counter()
        adapter = fixed[turn] if fixed else (router(chat, sid, history, text) if router else None)
        reply = checked(chat.turn(TurnRequest(sid, text, new_session=turn == 0, adapter=adapter, max_tokens=tokens,
                                              end_session=turn == turns - 1), timeout=600), sid)
        times.append(time.perf_counter() - t)
        replies.append(reply.token_ids)
        adapters.append(reply.adapter)
        generated += len(reply.token_ids)
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply.text}]
    return replies, adapters, generated


def run_setup(url: str, args, tag: str, fixed: dict[int, list[str]] | None,  # type: ignore[no-untyped-def]
              router: Router | None) -> dict:
    chats = [GrpcChat(url) for _ in range(args.sessions)]
    times: list[float] = []
    try:
        wall, out = run_together(args.sessions,
                                 lambda i: conversation(chats[i], f"{tag}-{i}", i, args.turns, args.tokens,
                                                        fixed[i] if fixed else None, router, times), tag)
    finally:
        for chat in chats:
            chat.close()
    generated = sum(v[2] for v in out.values())
    return {"wall": wall, "tokens": generated, "tok_s": generated / wall, "turn_s": statistics.median(times),
            "replies": {i: v[0] for i, v in out.items()}, "adapters": {i: v[1] for i, v in out.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--backend", default="onnx")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--work", type=Path, default=ROOT / "artifacts" / "bench_routing_serving")
    p.add_argument("--force", action="store_true",
                   help="overwrite the committed --out file and its figure (docs/benchmarks.md, docs/figures/)")
    args = p.parse_args()
    refuse_to_overwrite([args.out, args.out.parent / "figures" / "routing_serving.png"], args.force, "--out FILE")
    ensure_engines()
    descriptions = "\n".join(f"- {description_of(EMBEDDED / 'adapters' / name)}" for name in ADAPTERS)
    params = default_params(registry_root=str(args.work / "registry"), engine_backend=args.backend,
                            max_active_turns="32", max_queued_turns="64")
    with served(args.work, params) as server:
        print(f"server ready after {server.ready_seconds:.1f} s", flush=True)
        calibration = run_setup(server.grpc_url, args, "calibrate", None, None)  # warm-up + the routed adapters
        routers: dict[str, tuple[dict[int, list[str]] | None, Router | None]] = {
            SETUPS[0]: (calibration["adapters"], None),
            SETUPS[1]: (None, None),
            SETUPS[2]: (None, mol2_outside),
            SETUPS[3]: (None, mol_outside),
            SETUPS[4]: (None, contextual_outside(descriptions)),
        }
        results: dict[str, list[dict]] = {s: [] for s in SETUPS}
        with tqdm(total=args.rounds * len(SETUPS), desc="setups x rounds") as bar:
            for r in range(args.rounds):
                for s in SETUPS[r % len(SETUPS):] + SETUPS[:r % len(SETUPS)]:
                    fixed, router = routers[s]
                    results[s].append(run_setup(server.grpc_url, args, f"r{r}-{SETUPS.index(s)}", fixed, router))
                    bar.update()
    same = all(run["replies"] == calibration["replies"] for s in SETUPS[:2] for run in results[s])
    text = render(args, results, same, calibration)
    plot(args.out.parent / "figures" / "routing_serving.png", results)
    write_section(args.out, text, SECTION, title="# Benchmarks: the article's serving results, reproduced")
    print(text)
    return 0


def render(args, results: dict[str, list[dict]], same: bool, calibration: dict) -> str:  # type: ignore[no-untyped-def]
    med = {s: {k: statistics.median(run[k] for run in runs) for k in ("tok_s", "turn_s", "wall", "tokens")}
           for s, runs in results.items()}
    base = med[SETUPS[0]]["tok_s"]
    routed = [a for adapters in calibration["adapters"].values() for a in adapters]
    lines = [
        SECTION, "",
        f"Produced by `.venv/bin/python -m benchmarks routing-serving --sessions {args.sessions} --turns "
        f"{args.turns} --tokens {args.tokens} --rounds {args.rounds}` ({time.strftime('%Y-%m-%d')}, tritonserver on "
        f"loopback, onnx engines; {args.sessions} concurrent gRPC streams, {args.turns} turns each, the domain "
        "changing every turn; setups interleaved, the order rotating each round; medians over rounds).", "",
        "| setup | answer tokens/s | time per turn (median) | wall time | vs fixed route | per round (tokens/s) |",
        "|---|---|---|---|---|---|",
    ]
    for s in SETUPS:
        m = med[s]
        per_round = ", ".join(f"{run['tok_s']:.0f}" for run in results[s])
        lines.append(f"| {s} | {m['tok_s']:.0f} | {m['turn_s'] * 1e3:.0f} ms | {m['wall']:.1f} s | "
                     f"{(m['tok_s'] / base - 1) * 100:+.1f}% | {per_round} |")
    ratio = med[SETUPS[1]]["tok_s"] / base
    lines += [
        "",
        f"- MoL2 in the engine / fixed route: **{ratio:.3f}x** answer tokens/s (target: >= 0.95x; the article: +2.6%). "
        f"The two setups decoded the same tokens in every round: {'yes' if same else 'NO'} (the fixed route names the "
        "adapters MoL2 chose in a calibration run).",
        "- Adapters MoL2 chose over the workload's turns: "
        + ", ".join(f"{a} {routed.count(a)}" for a in sorted(set(routed))) + ".",
        "- Outside the engine, routing is a second request that must see the conversation (here a throw-away session "
        "rebuilt from `history`): it re-encodes the whole conversation per turn, and MoL also decodes a label. The "
        "article: -42.9% (MoL2 outside), -50.1% (Contextual MoL), -60.2% (MoL).",
        "",
        "![throughput by routing placement](figures/routing_serving.png)",
    ]
    return "\n".join(lines)


def plot(path: Path, results: dict[str, list[dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = [statistics.median(run["tok_s"] for run in results[s]) for s in SETUPS]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.barh(range(len(SETUPS)), values, color=["grey", "tab:green", "tab:orange", "tab:red", "tab:purple"])
    ax.set_yticks(range(len(SETUPS)), [s.replace(" (cost stand-in)", "*") for s in SETUPS])
    ax.invert_yaxis()
    ax.set_xlabel("answer tokens/s (median over rounds)")
    ax.set_title("Throughput by where routing runs")
    save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
