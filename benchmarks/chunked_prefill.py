"""Streams already going while a long prompt arrives: their longest inter-token gap and the long prompt's time to first
token, with the prefill run whole on arrival (before) and one chunk at a time between decode steps (after), side by
side in one run through real tritonservers.

    .venv/bin/python -m benchmarks chunked-prefill [--long-tokens 7168] [--streams 4] [--rounds 2] [--out docs/load.md]

Per mode, one server (the same engines and repository, only `prefill_between_steps` and `replay_tokens_per_step`
differ: false / 0 is how every turn was served before issue 49). Per round: `--streams` sessions stream greedy
replies (ignore_eos, no speculative decoding: one streamed response per token); once each has streamed 24 tokens a new
session sends a prompt of about `--long-tokens` tokens. Every streamed token's arrival is timed. Reported per mode,
over the rounds: the median inter-token gap of the streams outside the long prompt's prefill, their longest gap from
the long prompt's request until its first token, that gap over the median gap, the long prompt's TTFT, and the gap
over that TTFT. Figure: each stream's gaps against time, around the long prompt, for the first round of each mode.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import (
    EMBEDDED,
    ROOT,
    default_params,
    ensure_engines,
    figure_link,
    refuse_to_overwrite,
    save_figure,
    served,
    write_section,
)
from benchmarks.prefix_cache import document
from ced.text.tokenizer import ChatTokenizer
from tritonserver_backend.clients.client import GrpcChat, TurnRequest

SECTION = "## Measured: streams while a long prompt is prefilled (benchmarks/chunked_prefill.py)"
MODES = {"whole prefill (before)": {"prefill_between_steps": "false", "replay_tokens_per_step": "0"},
         "chunked between steps": {}}
WARM_TOKENS = 24  # tokens each stream has sent before the long prompt goes out


@dataclass
class Round:
    arrivals: list[list[float]] = field(default_factory=list)  # per stream: each token's arrival (perf_counter)
    long_sent: float = 0.0
    long_first: float = 0.0

    def gaps(self, inside: bool) -> list[float]:
        """The streams' inter-token gaps that end inside (or outside) [long_sent, long_first + 1 gap]."""
        out = []
        for times in self.arrivals:
            for a, b in zip(times, times[1:]):
                during = b > self.long_sent and a < self.long_first
                if during == inside:
                    out.append(b - a)
        return out


def stream(url: str, text: str, max_tokens: int, arrivals: list[float], started: threading.Event) -> None:
    chat = GrpcChat(url)
    try:
        def on_piece(_: str) -> None:
            arrivals.append(time.perf_counter())
            if len(arrivals) == WARM_TOKENS:
                started.set()

        reply = chat.turn(TurnRequest(f"cp-{uuid.uuid4().hex}", text, new_session=True, max_tokens=max_tokens,
                                      ignore_eos=True, speculative=False, end_session=True), on_piece=on_piece)
        if reply.error:
            raise RuntimeError(reply.error)
    finally:
        started.set()
        chat.close()


def one_round(url: str, long_text: str, streams: int, max_tokens: int) -> Round:
    result = Round(arrivals=[[] for _ in range(streams)])
    ready = [threading.Event() for _ in range(streams)]
    threads = [threading.Thread(target=stream, args=(url, f"Tell me about the number {i}.", max_tokens,
                                                      result.arrivals[i], ready[i])) for i in range(streams)]
    for t in threads:
        t.start()
    for event in ready:
        event.wait(120)
    chat = GrpcChat(url)
    try:
        first: list[float] = []
        result.long_sent = time.perf_counter()
        reply = chat.turn(TurnRequest(f"cp-long-{uuid.uuid4().hex}", long_text + "\nWhich card is widest?",
                                      new_session=True, max_tokens=2, end_session=True, speculative=False),
                          on_piece=lambda _: first.append(time.perf_counter()) if not first else None)
        if reply.error:
            raise RuntimeError(reply.error)
        result.long_first = first[0]
    finally:
        chat.close()
    for t in threads:
        t.join()
    if any(len(a) < max_tokens for a in result.arrivals):
        raise RuntimeError("a stream ended before its max_tokens; the gaps would be incomplete")
    if max(a[-1] for a in result.arrivals) < result.long_first:
        raise RuntimeError("the streams ended before the long prompt's first token: raise --stream-tokens")
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--long-tokens", type=int, default=7168)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=400, help="tokens each stream generates")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "load.md")
    p.add_argument("--figure", type=Path, default=ROOT / "docs" / "figures" / "chunked_prefill.png")
    p.add_argument("--work", type=Path, default=ROOT / "artifacts" / "bench_chunked_prefill")
    p.add_argument("--force", action="store_true", help="overwrite the committed --out file and figure")
    args = p.parse_args()
    refuse_to_overwrite([args.out, args.figure], args.force, "--out FILE / --figure FILE")
    ensure_engines()
    tokenizer = ChatTokenizer.load(EMBEDDED)
    rounds: dict[str, list[Round]] = {}
    for mode, extra in MODES.items():
        params = default_params(registry_root=str(args.work / "registry"),
                                max_context=str(args.long_tokens + 1024), **extra)
        with served(args.work / mode.split()[0], params) as server:
            chat = GrpcChat(server.grpc_url)
            chat.turn(TurnRequest("cp-warm-up", "hello", new_session=True, max_tokens=2, end_session=True))
            chat.close()
            for r in range(args.rounds):
                # a fresh document per round and mode: no prefix cache hit
                text = document(tokenizer, args.long_tokens, seed=7000 + r + 100 * len(rounds))
                got = one_round(server.grpc_url, text, args.streams, args.stream_tokens)
                rounds.setdefault(mode, []).append(got)
                print(f"{mode}, round {r + 1}: TTFT {(got.long_first - got.long_sent) * 1e3:.0f} ms, longest gap "
                      f"{max(got.gaps(True)) * 1e3:.0f} ms, median gap {statistics.median(got.gaps(False)) * 1e3:.1f} "
                      "ms", flush=True)
    text = render(args, rounds)
    figure(args.figure, rounds)
    write_section(args.out, text, SECTION)
    print(text)
    return 0


def summary(rounds: list[Round]) -> dict[str, float]:
    median_gap = statistics.median([g for r in rounds for g in r.gaps(False)])
    longest = statistics.median([max(r.gaps(True)) for r in rounds])
    ttft = statistics.median([r.long_first - r.long_sent for r in rounds])
    return {"median": median_gap, "longest": longest, "ttft": ttft}


def render(args: argparse.Namespace, rounds: dict[str, list[Round]]) -> str:
    lines = [SECTION, "",
             f"`.venv/bin/python -m benchmarks chunked-prefill --long-tokens {args.long_tokens} --streams "
             f"{args.streams} --rounds {args.rounds}` ({time.strftime('%Y-%m-%d')}; onnx engines of the embedded "
             "default, the 2-core CPU machine; the chunked server prefills 64 tokens per iteration, "
             "`prefill_tokens_per_step`, and joins 512 replayed positions per iteration, `replay_tokens_per_step`). "
             f"{args.streams} sessions stream greedy tokens; a new session sends a prompt of about {args.long_tokens} "
             "tokens. Medians over the rounds: the streams' median inter-token gap outside the long prompt's prefill, "
             "their longest gap while it is prefilled, and the long prompt's time to first token.", "",
             "| prefill | median gap ms | longest gap ms | longest / median | long prompt TTFT ms "
             "| longest gap / TTFT |",
             "|---|---|---|---|---|---|"]
    stats = {mode: summary(r) for mode, r in rounds.items()}
    for mode, s in stats.items():
        lines.append(f"| {mode} | {s['median'] * 1e3:.1f} | {s['longest'] * 1e3:.0f} | "
                     f"{s['longest'] / s['median']:.1f}x | {s['ttft'] * 1e3:.0f} | {s['longest'] / s['ttft']:.2f}x |")
    before, after = stats["whole prefill (before)"], stats["chunked between steps"]
    lines += ["", f"Chunked / whole: longest gap {after['longest'] / before['longest']:.2f}x, the long prompt's TTFT "
              f"{after['ttft'] / before['ttft']:.2f}x.", "",
              f"![inter-token gaps around the long prompt]({figure_link(args.figure, args.out)})"]
    return "\n".join(lines) + "\n"


def figure(path: Path, rounds: dict[str, list[Round]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rounds), figsize=(6 * len(rounds), 3.6), sharey=True)
    for ax, (mode, got) in zip(axes, rounds.items()):
        r = got[0]
        for i, times in enumerate(r.arrivals):
            ax.plot([b - r.long_sent for b in times[1:]], [(b - a) * 1e3 for a, b in zip(times, times[1:])],
                    lw=0.8, label=f"stream {i + 1}")
        ax.axvspan(0, r.long_first - r.long_sent, color="0.9", label="long prompt: request to first token")
        ax.set_title(mode)
        ax.set_xlabel("seconds since the long prompt was sent")
        ax.set_yscale("log")
    axes[0].set_ylabel("inter-token gap, ms")
    axes[0].legend(fontsize=7)
    save_figure(fig, path)
