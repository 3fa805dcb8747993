"""A storm of distinct long prefixes under small budgets: the encoder's memory stays within its two budgets.

Why: before pins were taken when a turn takes a cache entry (issue 63), another turn's insert could evict an entry
between a turn's lookup and its hand-over; the session then rested on an entry no longer in the cache, and its bytes
counted in neither budget, growing until the process was killed. Here every session opens with its own long prompt
(no two share a block), each turn is committed as the decoder would, and the process's resident memory and both
budgets' accounts are read after every batch of sessions.

    .venv/bin/python -m benchmarks prefix-storm                    # 200 sessions of 4096 tokens (about 5 min)
    .venv/bin/python -m benchmarks prefix-storm --sessions 40 --tokens 1024

Prints a table and writes it into docs/prefix_cache.md between its markers (`--force` rewrites a committed table).
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tritonserver_backend.core import counters as k
from tritonserver_backend.core.encoder_service import EncoderService
from tritonserver_backend.core.resting_rows import RestingRow
from tritonserver_backend.engines import open_engine

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "prefix_cache.md"
BEGIN, END = "<!-- prefix-storm:begin -->", "<!-- prefix-storm:end -->"
MIB = 1 << 20


def resident_bytes() -> int:
    """This process's resident set (VmRSS), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def storm(service: EncoderService, sessions: int, tokens: int, every: int, seed: int) -> list[dict[str, float]]:
    """Start `sessions` sessions with distinct prompts of `tokens` tokens, committing each turn; a row of readings
    after every `every` sessions."""
    rng = np.random.default_rng(seed)
    vocab = service.cfg.vocab_size
    rows = []
    for i in tqdm(range(sessions), desc="sessions", unit="session"):
        sid = f"storm-{i}"
        encoded = service.encode_turn(sid, rng.integers(5, vocab, tokens).astype(np.int64), start=True)
        service.encode_step([sid], np.zeros((1, 0), np.int64), turn_done=True, turn_ids=np.asarray([encoded.turn_id]))
        if (i + 1) % every == 0 or i + 1 == sessions:
            values = list(service.sessions._items.values())
            orphans = sum(1 for v in values if isinstance(v, RestingRow) and not service.prefix_cache.holds(v.base))
            rows.append({"sessions": i + 1, "rss": resident_bytes(), "session_bytes": service.sessions.total_bytes(),
                         "cache_bytes": service.prefix_cache.total_bytes(), "live": len(values),
                         "evictions": service.counters.get(k.PREFIX_EVICTIONS), "orphans": orphans,
                         "largest": max(v.nbytes() for v in values)})
    return rows


def table(rows: list[dict[str, float]], base_rss: int, session_budget: int, cache_budget: int, tokens: int) -> str:
    lines = [f"| sessions ({tokens}-token prompts) | resident − start (MiB) | session bytes (MiB, budget "
             f"{session_budget / MIB:.0f}) | cache bytes (MiB, budget {cache_budget / MIB:.0f}) | sessions held | "
             "cache evictions | resting on an evicted entry |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['sessions']} | {(r['rss'] - base_rss) / MIB:.1f} | {r['session_bytes'] / MIB:.1f} | "
                     f"{r['cache_bytes'] / MIB:.1f} | {r['live']} | {r['evictions']:.0f} | {r['orphans']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length of every session")
    parser.add_argument("--session-budget-mib", type=int, default=64)
    parser.add_argument("--cache-budget-mib", type=int, default=32)
    parser.add_argument("--every", type=int, default=25, help="sessions between two readings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engines", type=Path, default=ROOT / "artifacts" / "engines" / "mol2-small")
    parser.add_argument("--force", action="store_true", help="rewrite the committed table in docs/prefix_cache.md")
    parser.add_argument("--no-doc", action="store_true", help="print only")
    args = parser.parse_args()
    engine = open_engine("onnx", ROOT / "embedded" / "mol2-small", args.engines)
    session_budget, cache_budget = args.session_budget_mib * MIB, args.cache_budget_mib * MIB
    service = EncoderService(engine, session_budget, max_context=max(8192, args.tokens + 16), session_auth=False,
                             prefix_cache_bytes=cache_budget)
    # the start reading includes the engine's own working memory for prompts of this length (one session of it,
    # then ended): what grows after it is the sessions' and the cache's
    warm_ids = np.random.default_rng(args.seed + 1).integers(5, engine.cfg.vocab_size, args.tokens).astype(np.int64)
    warm = service.encode_turn("warm-up", warm_ids, start=True)
    service.encode_step(["warm-up"], np.zeros((1, 0), np.int64), turn_done=True, turn_ids=np.asarray([warm.turn_id]))
    service.end("warm-up")
    base_rss = resident_bytes()
    started = time.perf_counter()
    rows = storm(service, args.sessions, args.tokens, args.every, args.seed)
    elapsed = time.perf_counter() - started
    peak_growth = max(r["rss"] for r in rows) - base_rss
    text = table(rows, base_rss, session_budget, cache_budget, args.tokens)
    accounted = rows[-1]["session_bytes"] + rows[-1]["cache_bytes"]
    settled = rows[min(1, len(rows) - 1)]
    summary = (f"{args.sessions} sessions in {elapsed:.0f} s ({time.strftime('%Y-%m-%d')}, onnx engines, 2-core "
               f"machine). Resident memory grew at most {peak_growth / MIB:.1f} MiB over the start against "
               f"{(session_budget + cache_budget) / MIB:.0f} MiB of budgets, of which both budgets' accounts hold "
               f"{accounted / MIB:.1f} MiB at the end; the rest, {(peak_growth - accounted) / MIB:.1f} MiB, is the "
               f"constant (freed arrays the allocator keeps for reuse, and the engine's working memory): from "
               f"session {settled['sessions']} to {rows[-1]['sessions']} resident memory moved by "
               f"{(rows[-1]['rss'] - settled['rss']) / MIB:+.1f} MiB while the sessions beyond the budget were "
               f"evicted. The store keeps its newest session whole even above its budget, so the session bytes may "
               f"pass it by one session ({rows[-1]['largest'] / MIB:.1f} MiB here).")
    print(text + "\n\n" + summary)
    if not args.no_doc:
        write_doc(text + "\n\n" + summary, args.force)
    return 0


def write_doc(block: str, force: bool) -> None:
    doc = DOC.read_text()
    fresh = f"{BEGIN}\n{block}\n{END}"
    if BEGIN in doc:
        if not force:
            print(f"{DOC} already holds a table; --force rewrites it")
            return
        doc = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: fresh, doc, flags=re.S)
    else:
        doc = doc.rstrip("\n") + "\n\n## A storm of distinct prefixes (benchmarks/prefix_storm.py)\n" + fresh + "\n"
    DOC.write_text(doc)
    print(f"wrote {DOC}")


if __name__ == "__main__":
    raise SystemExit(main())
