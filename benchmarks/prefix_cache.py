"""Time to first token with the encoder's prefix cache: cold vs a hit, under the same adapter and under another one,
for shared prefixes of several lengths, measured side by side in one run through a real tritonserver.

    .venv/bin/python -m benchmarks prefix-cache [--lengths 1024 4096 7168] [--rounds 3] [--out docs/prefix_cache.md]

For each length: a document of about that many tokens (seeded words), then per round, in this order: a cold session
(the document behind a fresh `cache_salt`, so nothing is cached for it), a warming session in the shared partition (it
stores the document), a session with the same document and another question under the warming session's adapter, and
one under another adapter. Each session is new (`new_session`), asks for 4 greedy tokens and is timed from the
request to its first streamed token. Medians over the rounds, and hit / cold. Written into `docs/prefix_cache.md`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import uuid
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
from ced.text.tokenizer import ChatTokenizer
from tritonserver_backend.clients.client import GrpcChat, TurnRequest

SECTION = "## Measured: time to first token, cold vs hit (benchmarks/prefix_cache.py)"
WORDS = ("card", "flex", "padding", "margin", "grid", "header", "footer", "button", "color", "border", "shadow",
         "width", "height", "gap", "align", "center", "font", "weight", "line", "space")


def document(tokenizer: ChatTokenizer, tokens: int, seed: int) -> str:
    """Seeded words until the text is about `tokens` tokens long."""
    rng = random.Random(seed)
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < tokens:
        words += [rng.choice(WORDS) for _ in range(max(16, (tokens - len(tokenizer.encode(" ".join(words)))) // 2))]
    return " ".join(words)


def first_token_seconds(chat: GrpcChat, text: str, adapter: str, salt: str | None) -> float:
    """Seconds from sending a new session's turn to its first streamed token."""
    started = time.perf_counter()
    first: list[float] = []
    reply = chat.turn(TurnRequest(f"pc-{uuid.uuid4().hex}", text, new_session=True, adapter=adapter, max_tokens=4,
                                  cache_salt=salt, end_session=True),
                      on_piece=lambda _: first.append(time.perf_counter()) if not first else None)
    if reply.error:
        raise RuntimeError(reply.error)
    return (first[0] if first else time.perf_counter()) - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 7168], help="shared prefix tokens")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--adapters", nargs=2, default=["L3_design", "L2_code"], help="the warming adapter, another one")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "prefix_cache.md")
    p.add_argument("--figure", type=Path, default=ROOT / "docs" / "figures" / "prefix_cache_ttft.png")
    p.add_argument("--work", type=Path, default=ROOT / "artifacts" / "bench_prefix_cache")
    p.add_argument("--force", action="store_true", help="overwrite the committed --out file and figure")
    args = p.parse_args()
    refuse_to_overwrite([args.out, args.figure], args.force, "--out FILE / --figure FILE")
    ensure_engines()
    tokenizer = ChatTokenizer.load(EMBEDDED)
    same, other = args.adapters
    params = default_params(registry_root=str(args.work / "registry"), max_context=str(max(args.lengths) + 1024))
    times: dict[tuple[int, str], list[float]] = {}
    with served(args.work, params) as server:
        chat = GrpcChat(server.grpc_url)
        try:
            chat.turn(TurnRequest("pc-warm-up", "hello", new_session=True, max_tokens=2, end_session=True))
            for length in args.lengths:
                for r in range(args.rounds):
                    text = document(tokenizer, length, seed=1000 * length + r)
                    runs = {"cold": (text + "\nWhat is the widest card?", same, f"cold-{uuid.uuid4().hex}"),
                            "warming": (text + "\nList the colours.", same, None),
                            "hit, same adapter": (text + "\nWhich gap is used?", same, None),
                            "hit, other adapter": (text + "\nHow tall is the header?", other, None)}
                    for name, (prompt, adapter, salt) in runs.items():
                        times.setdefault((length, name), []).append(first_token_seconds(chat, prompt, adapter, salt))
                    print(f"{length} tokens, round {r + 1}: " + ", ".join(
                        f"{n} {times[(length, n)][-1] * 1e3:.0f} ms" for n in runs), flush=True)
        finally:
            chat.close()
    text = render(args, times)
    figure(args.figure, args.lengths, times)
    write_section(args.out, text, SECTION, title="# The encoder's prefix cache")
    print(text)
    return 0


def render(args: argparse.Namespace, times: dict[tuple[int, str], list[float]]) -> str:
    lines = [SECTION, "",
             f"`.venv/bin/python -m benchmarks prefix-cache --lengths {' '.join(map(str, args.lengths))} --rounds "
             f"{args.rounds}` ({time.strftime('%Y-%m-%d')}; onnx engines of the embedded default, one tritonserver, "
             "the 2-core CPU machine): medians over the rounds of the time from a new session's request to its first "
             "streamed token.", "",
             "| shared prefix tokens | cold ms | hit, same adapter ms | hit / cold | hit, other adapter ms "
             "| hit / cold |",
             "|---|---|---|---|---|---|"]
    for length in args.lengths:
        cold = statistics.median(times[(length, "cold")])
        same = statistics.median(times[(length, "hit, same adapter")])
        other = statistics.median(times[(length, "hit, other adapter")])
        lines.append(f"| {length} | {cold * 1e3:.0f} | {same * 1e3:.0f} | {same / cold:.2f}x | {other * 1e3:.0f} | "
                     f"{other / cold:.2f}x |")
    lines += ["", f"![time to first token, cold vs hit]({figure_link(args.figure, args.out)})"]
    return "\n".join(lines) + "\n"


def figure(path: Path, lengths: list[int], times: dict[tuple[int, str], list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ("cold", "hit, same adapter", "hit, other adapter")
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([j + i * width for j in range(len(lengths))],
               [statistics.median(times[(n, name)]) * 1e3 for n in lengths], width, label=name)
    ax.set_xticks([j + width for j in range(len(lengths))], [str(n) for n in lengths])
    ax.set_xlabel("shared prefix, tokens")
    ax.set_ylabel("time to first token, ms (median)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
