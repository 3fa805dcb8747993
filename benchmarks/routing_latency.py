"""Routing latency of MoL2 vs Contextual MoL vs MoL, side by side in one run; writes docs/routing_latency.md + a plot.

    .venv/bin/python -m benchmarks routing-latency                       # embedded default, default buckets
    .venv/bin/python -m benchmarks routing-latency --buckets 64,256,1024,4096 --repeats 10

For each input-length bucket, a history of exactly that many tokens of held-out text (a user and an assistant turn
of the prepared corpora's base `test` documents) is encoded once; then, per repetition, a fork of it receives a new
user turn (an adapter-benchmark query from artifacts/routing/adapter.jsonl, rendered by the chat template) and the
three routers decide, in rotating order, among the four deployed adapter descriptions. MoL2 and Contextual MoL read
the user turn's H19 from the hand-over that this prefill returned (no extra pass). Only the decision is timed
(each router's per-option-list caches are warmed first, so MoL2 runs with its warm option cache, as in serving).
Warm-up repetitions come first and are not counted.

Per bucket the turn itself is also measured once per sample: the bounded replay under the correct target adapter
and a greedy decode of `--decode-tokens` tokens (per-token decode time). Routing's share of a turn is
route / (route + replay + (N - 1) x per-token decode) for N decoded tokens: N = 1 and N <= --decode-tokens use
measured decode, larger N (4,096 by default) are extrapolated from the measured per-token time and marked so.
Routing every k generated tokens costs route / k per token; it is reported against the measured per-token decode.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from build_engines.committed import refuse_to_overwrite  # noqa: E402
from build_engines.routing.baselines import ContextualMoLRouter, MoL2Router, MoLRouter, Router  # noqa: E402
from build_engines.routing.data import ADAPTER_DESCRIPTIONS, BENCHMARK_TASK, load_items  # noqa: E402
from ced.conversation import Conversation  # noqa: E402
from ced.formats.checkpoint import load_checkpoint  # noqa: E402
from ced.lora import AdapterBank  # noqa: E402
from ced.model.state import HandOver  # noqa: E402
from ced.text.tokenizer import ASSISTANT, USER, ChatTokenizer, Message  # noqa: E402

L0 = "L0_chat"
DECODE_POINTS = (1, 256, 4096)
EVERY_K = (16, 64, 256)
FALLBACK_QUERIES = {
    "L0_chat": "hey, how was your weekend? I missed you at the party.",
    "L1_agent": "how do I list every file, hidden ones too, with ls and sort them by size?",
    "L2_code": "def mean(xs):\n    return sum(xs) / len(xs)\nwhy does this fail on an empty list?",
    "L3_design": ".card { display: flex; gap: 8px; } how do I centre the items vertically?",
}


@dataclass
class Bucket:
    tokens: int
    prefill_s: float = 0.0
    times: dict[str, list[float]] = field(default_factory=dict)  # router -> decision seconds
    correct: dict[str, int] = field(default_factory=dict)
    label_tokens: list[int] = field(default_factory=list)  # MoL
    parsed: list[bool] = field(default_factory=list)  # MoL
    option_tokens: list[int] = field(default_factory=list)  # Contextual MoL
    replay_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)  # every measured decode step
    decode_totals: list[float] = field(default_factory=list)  # sum of the steps of each measured decode
    untouched: bool = True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("embedded/mol2-small"))
    p.add_argument("--buckets", default="64,256,1024,4096",
                   help="history lengths in tokens before the user turn, comma-separated (default 64,256,1024,4096)")
    p.add_argument("--repeats", type=int, default=10, help="timed decisions per router and bucket")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed warm-up decisions per router and bucket, before the timed ones")
    p.add_argument("--decode-tokens", type=int, default=256, help="tokens decoded (measured) per turn sample")
    p.add_argument("--turn-samples", type=int, default=1, help="turn measurements (replay + decode) per bucket")
    p.add_argument("--max-label-tokens", type=int, default=24, help="MoL's label budget")
    p.add_argument("--contextual-fit", type=int, default=0, help="train the Contextual MoL q/k head on this many "
                   "adapter-routing train items first (0: untrained, timing only)")
    p.add_argument("--data", type=Path, default=Path("artifacts/data"), help="prepared corpora (held-out history text)")
    p.add_argument("--routing", type=Path, default=Path("artifacts/routing"), help="routing items (queries)")
    p.add_argument("--out", type=Path, default=Path("docs/routing_latency.md"))
    p.add_argument("--force", action="store_true",
                   help="overwrite the committed --out file and its figure (docs/routing_latency.md, docs/figures/)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        args.bucket_list = sorted({int(b) for b in args.buckets.split(",") if b.strip()})
    except ValueError:
        p.error(f"--buckets must be comma-separated integers, got {args.buckets!r}")
    if not args.bucket_list or min(args.bucket_list) < 8:
        p.error("every bucket must be at least 8 tokens")
    if args.repeats < 1 or args.warmup < 0 or args.decode_tokens < 2 or args.turn_samples < 1:
        p.error("--repeats, --turn-samples must be >= 1, --warmup >= 0, --decode-tokens >= 2")
    return args


# ------------------------------------------------------------------------------------------------ inputs


def held_out_tokens(tok: ChatTokenizer, data: Path, routing: Path, needed: int) -> tuple[list[int], str]:
    """At least `needed` token ids of held-out text: base `test` documents, else generic test queries."""
    pieces: list[int] = []
    try:
        from build_engines.data.corpora.reader import iter_documents, sources

        names = sources(data, "base")
        docs = [iter_documents(data, s, "test") for s in names]
        while len(pieces) < needed and docs:
            for it in list(docs):
                doc = next(it, None)
                if doc is None:
                    docs.remove(it)
                    continue
                pieces.extend(tok.encode(doc[:4000] + "\n"))
        if len(pieces) >= needed:
            return pieces, f"base `test` documents of {data} ({', '.join(names)})"
    except Exception as exc:  # noqa: BLE001 (any missing/unprepared data falls back)
        print(f"[bench] no held-out corpus text ({exc}); using generic test queries", file=sys.stderr)
    pieces = []
    try:
        texts = [it["query"] for it in load_items(routing, "generic") if it["split"] == "test"]
    except Exception:  # noqa: BLE001
        texts = list(FALLBACK_QUERIES.values())
    i = 0
    while len(pieces) < needed:
        pieces.extend(tok.encode(texts[i % len(texts)] + "\n"))
        i += 1
    return pieces, "generic test queries (no prepared corpora)"


def history_ids(tok: ChatTokenizer, text: list[int], n: int, offset: int) -> list[int]:
    """Exactly n tokens: <|bos|> <|user|> text <|end|> <|assistant|> text <|end|>."""
    body = n - 5
    a = body // 2
    chunk = [text[(offset + i) % len(text)] for i in range(body)]
    user, assistant, end = tok.special_ids[USER], tok.special_ids[ASSISTANT], tok.end_of_turn_id
    ids = [tok.bos_id, user, *chunk[:a], end, assistant, *chunk[a:], end]
    assert len(ids) == n
    return ids


def benchmark_queries(routing: Path, count: int, seed: int) -> list[tuple[str, str]]:
    """(query text, correct adapter) pairs, interleaved over the four domains."""
    try:
        items = [it for it in load_items(routing, "adapter") if it["task"] == BENCHMARK_TASK]
    except Exception:  # noqa: BLE001
        items = []
    if not items:
        pairs = [(q, name) for name, q in FALLBACK_QUERIES.items()]
        return [pairs[i % len(pairs)] for i in range(count)]
    by_label: dict[str, list[dict]] = {}
    for it in items:
        by_label.setdefault(it["label"], []).append(it)
    labels = sorted(by_label)
    return [(by_label[labels[i % len(labels)]][
                 (i // len(labels) + seed) % len(by_label[labels[i % len(labels)]])]["query"],
             labels[i % len(labels)]) for i in range(count)]


def _clone_rows(rows: HandOver | None) -> HandOver | None:
    return None if rows is None else HandOver(*(getattr(rows, f).clone() for f in rows.__dataclass_fields__))


# ------------------------------------------------------------------------------------------------ stats


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def p95(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(0.95 * (len(s) - 1)))))]


def fmt_time(seconds: float) -> str:
    if seconds != seconds:
        return "n/a"
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"


def fmt_pct(x: float) -> str:
    if x != x:
        return "n/a"
    if x >= 1.0:
        return f"{x:.1f}%"
    if x >= 0.01:
        return f"{x:.2f}%"
    if x >= 0.001:
        return f"{x:.3f}%"
    return "< 0.001%"


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    refuse_to_overwrite([args.out, args.out.parent / "figures" / "routing_latency.png"], args.force, "--out FILE")
    wall_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = args.model
    if not (model / "model.safetensors").exists():
        print(f"error: no model at {model} (model.safetensors missing); build it with python -m "
              "build_engines.training.build_default", file=sys.stderr)
        return 1
    net = load_checkpoint(model)
    enc, dec = net.split()
    enc.eval(), dec.eval()
    bank = AdapterBank(net.cfg, dec)
    bank.attach(dec)
    adapters = bank.load_bundled(model)
    tok = ChatTokenizer.load(model)
    names = list(ADAPTER_DESCRIPTIONS)
    options = [ADAPTER_DESCRIPTIONS[n] for n in names]  # the deployed set, in a fixed order

    mol = MoLRouter(tok, adapters.get(L0), max_label_tokens=args.max_label_tokens)
    ctx = ContextualMoLRouter(enc, tok, seed=args.seed)
    mol2 = MoL2Router.from_model(model, net.embed.weight, tok, seed=args.seed)
    routers: list[Router] = [mol2, ctx, mol]
    ctx_note = "untrained q/k head (timing does not depend on the weights)"
    if args.contextual_fit > 0:
        train = [it for it in load_items(args.routing, "adapter") if it["task"] == "adapter_routing"
                 and it["split"] == "train"][: args.contextual_fit]
        t = time.perf_counter()
        losses = ctx.fit([(tok.turn(Message("user", it["query"]), generation_prompt=True), it["options"], it["answer"])
                          for it in tqdm(train, desc="contextual fit features", leave=False)], epochs=20)
        ctx_note = (f"q/k head fitted on {len(train)} adapter-routing train items ({time.perf_counter() - t:.0f} s; "
                    f"loss {losses[0]:.3f} -> {losses[-1]:.3f})")

    text, text_source = held_out_tokens(tok, args.data, args.routing, max(args.bucket_list) + 64)
    queries = benchmark_queries(args.routing, args.warmup + args.repeats + args.turn_samples, args.seed)
    target_of = {name: adapters.get(name) for name in names}

    buckets: list[Bucket] = []
    total = len(args.bucket_list) * (args.warmup + args.repeats + args.turn_samples)
    bar = tqdm(total=total, desc="routing latency", unit="step")
    for bi, n in enumerate(args.bucket_list):
        b = Bucket(n, times={r.name: [] for r in routers}, correct={r.name: 0 for r in routers})
        base = Conversation(enc, dec)
        hist = torch.tensor([history_ids(tok, text, n, offset=97 * bi)])
        t = time.perf_counter()
        for start in range(0, n, 512):
            base.extend(hist[:, start : start + 512])
        b.prefill_s = time.perf_counter() - t
        for r in range(args.warmup + args.repeats):
            query, label = queries[r]
            qids = tok.turn(Message("user", query), generation_prompt=True)
            conv = base.fork()
            h19 = conv.extend(torch.tensor([qids])).encoder_out  # the user turn's H19, from the normal prefill
            if r == args.warmup:  # check once per bucket that no router leaves a trace (outside the timing)
                enc_snap, rows_snap, src_snap = (conv.encoder_state.clone(), _clone_rows(conv.decoder.recent),
                                                 conv.decoder.sources.clone())
            shift = r % len(routers)
            for router in routers[shift:] + routers[:shift]:  # rotating order: no router always runs first
                router.prepare(options)
                d = router.timed(conv, qids, options, h19)
                if r < args.warmup:
                    continue
                b.times[router.name].append(d.seconds)
                b.correct[router.name] += int(d.index == names.index(label))
                if router is mol:
                    b.label_tokens.append(d.info["label_tokens"])
                    b.parsed.append(d.info["parsed"])
                if router is ctx:
                    b.option_tokens.append(d.info["option_tokens"])
            if r == args.warmup:
                ok = conv.encoder_state.equal(enc_snap) and conv.decoder.sources.equal(src_snap)
                ok = ok and rows_snap is not None and all(torch.equal(getattr(rows_snap, f),
                                                                      getattr(conv.decoder.recent, f))
                                                          for f in rows_snap.__dataclass_fields__)
                b.untouched = b.untouched and ok
            bar.update(1)
        for s in range(args.turn_samples):
            query, label = queries[args.warmup + args.repeats + s]
            qids = tok.turn(Message("user", query), generation_prompt=True)
            conv = base.fork()
            conv.extend(torch.tensor([qids]))
            target = target_of.get(label)
            for _ in range(2):  # replay is repeatable (it rebuilds the adapter rings): time it on forks, twice
                f = conv.fork()
                t = time.perf_counter()
                f.replay(target)
                b.replay_s.append(time.perf_counter() - t)
            out = conv.replay(target)
            steps = []
            for _ in range(args.decode_tokens - 1):
                token = int(out.logits[0, -1].argmax())
                t = time.perf_counter()
                out = conv.step(torch.tensor([[token]]))
                steps.append(time.perf_counter() - t)
            b.step_s.extend(steps)
            b.decode_totals.append(sum(steps))
            bar.update(1)
        buckets.append(b)
    bar.close()
    wall = time.perf_counter() - wall_start

    report = render(args, net.cfg.window_size, buckets, routers, mol, mol2, ctx_note, text_source, adapters, wall)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig_path = args.out.parent / "figures" / "routing_latency.png"
    plot(buckets, routers, fig_path, args.decode_tokens)
    report = report.replace("{FIGURE}", fig_path.relative_to(args.out.parent).as_posix())
    args.out.write_text(report)
    print(report)
    print(f"wrote {args.out} and {fig_path} (wall {wall:.1f} s)")
    return 0


def turn_seconds(b: Bucket, n_decoded: int, decode_tokens: int) -> tuple[float, bool]:
    """(turn time without routing for n decoded tokens, extrapolated?) from the bucket's measurements."""
    replay = mean(b.replay_s)
    if n_decoded <= 1:
        return replay, False
    if n_decoded <= decode_tokens:
        per_sample = len(b.step_s) // max(1, len(b.decode_totals))
        measured = mean([sum(b.step_s[i * per_sample : i * per_sample + n_decoded - 1])
                         for i in range(len(b.decode_totals))])
        return replay + measured, False
    return replay + (n_decoded - 1) * mean(b.step_s), True


def render(args: argparse.Namespace, window: int, buckets: list[Bucket], routers: list[Router], mol: MoLRouter,
           mol2: MoL2Router, ctx_note: str, text_source: str, adapters: dict, wall: float) -> str:
    names = [r.name for r in routers]
    all_times = {n: [t for b in buckets for t in b.times[n]] for n in names}
    all_steps = [s for b in buckets for s in b.step_s]
    lines = [
        "# Routing latency: MoL2 vs Contextual MoL vs MoL",
        "",
        "Generated by `benchmarks/routing_latency.py` on "
        f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}, one process, all routers on the same machine "
        f"({platform.machine()}, {platform.system()}, torch {torch.__version__}, {torch.get_num_threads()} threads). "
        f"Wall time {wall:.0f} s.",
        "",
        f"- Model: `{args.model}`; adapters: {', '.join(sorted(adapters)) or 'none'}; options: the four deployed "
        "adapter descriptions.",
        "- MoL2: "
        + ("trained pointer head from `" + str(args.model / "router") + "`" if mol2.trained
           else "**untrained** seeded pointer head (no `" + str(args.model / "router") + "`): timing only, decisions "
           "arbitrary")
        + "; warm option cache.",
        f"- Contextual MoL: {ctx_note}; options encoded after the query on a fork (temporary encoder branch, dropped).",
        f"- MoL: {'L0 adapter `' + L0 + '`' if mol.adapter is not None else '**base model** (no L0 adapter found)'} "
        f"decodes a label greedily, up to {args.max_label_tokens} tokens (stops at <|end|>), on a fork (rolled back).",
        f"- History before the user turn: {text_source}. Queries: held-out adapter-benchmark user turns. "
        f"{args.repeats} timed decisions per router and bucket after {args.warmup} warm-up ones, routers in rotating "
        "order.",
        f"- Every router left the conversation byte-identical (encoder state, global-KV mirror, hand-over rows): "
        f"{'yes' if all(b.untouched for b in buckets) else '**NO**'} (checked once per bucket).",
        "",
        "## Decision time by input length",
        "",
        "| History tokens | " + " | ".join(f"{n} mean / median / p95" for n in names) + " | Contextual MoL / MoL2 "
        "(means) | MoL / MoL2 (means) | Contextual MoL / MoL2 (medians) | MoL / MoL2 (medians) |",
        "|---|" + "---|" * (len(names) + 4),
    ]

    def row(label: str, times: dict[str, list[float]]) -> str:
        cells = [f"{fmt_time(mean(times[n]))} / {fmt_time(statistics.median(times[n]) if times[n] else float('nan'))} "
                 f"/ {fmt_time(p95(times[n]))}" for n in names]
        m2 = mean(times[mol2.name])
        med = {n: statistics.median(times[n]) for n in names}
        return (f"| {label} | " + " | ".join(cells) + f" | {mean(times['Contextual MoL']) / m2:,.0f}x | "
                f"{mean(times['MoL']) / m2:,.0f}x | {med['Contextual MoL'] / med[mol2.name]:,.0f}x | "
                f"{med['MoL'] / med[mol2.name]:,.0f}x |")

    for b in buckets:
        lines.append(row(f"{b.tokens:,}", b.times))
    lines.append(row("All", all_times))
    label_tokens = [t for b in buckets for t in b.label_tokens]
    parsed = [p for b in buckets for p in b.parsed]
    lines += [
        "",
        f"MoL decoded {mean(label_tokens):.1f} label tokens on average (a number was parsed in "
        f"{sum(parsed)}/{len(parsed)} labels; otherwise the highest number-token logit decided). Contextual MoL "
        f"encoded {mean([t for b in buckets for t in b.option_tokens]):.0f} option tokens per decision. Agreement with "
        "the correct adapter on the timed samples: "
        + ", ".join(f"{n} {sum(b.correct[n] for b in buckets)}/{sum(len(b.times[n]) for b in buckets)}" for n in names)
        + " (few samples; untrained heads decide arbitrarily).",
        "",
        "## Routing's share of a turn (routing once per turn)",
        "",
        f"Turn = routing + bounded replay (last {window} rows) under the correct target + decode of N tokens. Replay "
        f"and per-token decode are measured per bucket ({args.turn_samples} sample(s), {args.decode_tokens} decoded "
        f"tokens each); rows with N > {args.decode_tokens} are **extrapolated** from the measured per-token decode "
        "time.",
        "",
        "| History tokens | Tokens decoded | Turn without routing | " + " | ".join(names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for b in buckets:
        for n_dec in DECODE_POINTS:
            base, extrapolated = turn_seconds(b, n_dec, args.decode_tokens)
            shares = [fmt_pct(100 * mean(b.times[n]) / (mean(b.times[n]) + base)) for n in names]
            lines.append(f"| {b.tokens:,} | {n_dec:,}{' (extrapolated)' if extrapolated else ' (measured)'} | "
                         f"{fmt_time(base)} | " + " | ".join(shares) + " |")
    lines += [
        "",
        "Measured per bucket: " + "; ".join(f"{b.tokens:,} tokens: history prefill {fmt_time(b.prefill_s)}, replay "
                                            f"{fmt_time(mean(b.replay_s))}, decode "
                                            f"{fmt_time(mean(b.step_s))}/token" for b in buckets) + ".",
        "",
        "## Routing every k generated tokens",
        "",
        "Overhead per generated token = mean decision time (all buckets) / k, against the measured mean decode time "
        f"per token ({fmt_time(mean(all_steps))}, all buckets). Computed from the measured decision and decode times, "
        "not a separate run; an actual switch would add one bounded replay.",
        "",
        "| k | " + " | ".join(f"{n} per token (% of decode)" for n in names)
        + " | Contextual MoL / MoL2 | MoL / MoL2 |",
        "|---|" + "---|" * (len(names) + 2),
    ]
    step = mean(all_steps)
    for k in EVERY_K:
        cells = [f"{fmt_time(mean(all_times[n]) / k)} ({fmt_pct(100 * mean(all_times[n]) / (k * step))})"
                 for n in names]
        m2 = mean(all_times[mol2.name])
        lines.append(f"| {k} | " + " | ".join(cells)
                     + f" | {mean(all_times['Contextual MoL']) / m2:,.0f}x | {mean(all_times['MoL']) / m2:,.0f}x |")
    lines += ["", "![routing latency]({FIGURE})", ""]
    return "\n".join(lines)


def plot(buckets: list[Bucket], routers: list[Router], path: Path, decode_tokens: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [r.name for r in routers]
    colors = {"MoL2": "tab:green", "Contextual MoL": "tab:orange", "MoL": "tab:red"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    xs = range(len(buckets))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        means = [mean(b.times[n]) * 1e3 for b in buckets]
        p95s = [p95(b.times[n]) * 1e3 for b in buckets]
        pos = [x + (i - (len(names) - 1) / 2) * width for x in xs]
        ax.bar(pos, means, width, label=n, color=colors.get(n))
        ax.scatter(pos, p95s, marker="_", color="black", s=80, zorder=3)
    ax.set_xticks(list(xs), [f"{b.tokens:,}" for b in buckets])
    ax.set_yscale("log")
    ax.set_xlabel("history tokens before the user turn")
    ax.set_ylabel("decision time (ms, log)")
    ax.set_title("Decision time (bar: mean, tick: p95)")
    top = max(p95(b.times[n]) for b in buckets for n in names) * 1e3
    ax.set_ylim(top=top * 30)
    ax.legend(loc="upper left", fontsize=8, ncol=3)
    ax = axes[1]
    ns = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    for n in names:
        route = mean([t for b in buckets for t in b.times[n]])
        shares = [100 * route / (route + mean([turn_seconds(b, k, decode_tokens)[0] for b in buckets])) for k in ns]
        ax.plot(ns, shares, marker="o", ms=3, label=n, color=colors.get(n))
    ax.axvspan(decode_tokens, ns[-1], color="grey", alpha=0.15, label="extrapolated")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens decoded per turn")
    ax.set_ylabel("routing share of the turn (%)")
    ax.set_title("Routing once per turn (mean over buckets)")
    ax.legend()
    ax = axes[2]
    step = mean([s for b in buckets for s in b.step_s])
    ks = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    for n in names:
        route = mean([t for b in buckets for t in b.times[n]])
        ax.plot(ks, [route / (k * step) for k in ks], marker="o", ms=3, label=n, color=colors.get(n))
    ax.axhline(1.0, color="black", ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("route every k generated tokens")
    ax.set_ylabel("routing time / decode time")
    ax.set_title("Frequent switching (dashed: equal time)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
