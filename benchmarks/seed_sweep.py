"""The test suite's random-data bounds checked over many seeds: the step modules against the reference network.

    .venv/bin/python -m benchmarks seed-sweep [--seeds 200] [--first 0] [--workers 2] [--out FILE | --force]

Why: a test draws its random network from one fixed seed (tests/conftest.py), so it never fails by chance, but a
bound that held for one seed says little about the next. The bound of test_steps.py is derived from the arithmetic
(tests/build_engines/export/steps_walk.py: reordered float32 rounding, plus the Engram gate's discontinuity at 0);
this runs the same walk for `--seeds` seeds of each variant (plain, Engram) and reports how much of the bound the
worst seed used, which walks met a top-k near-tie (the bound holds up to the first one, steps_walk.NearTies) and what
followed it, and whether any seed's greedy token differed. It fails (exit 1) when a seed breaks the bound before its
first near-tie or its greedy token differs, and writes its table into docs/testing.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks.harness import ROOT, refuse_to_overwrite, write_section

SECTION = "## Measured: the step-module bound over a seed sweep (benchmarks/seed_sweep.py)"


@dataclass(frozen=True)
class SeedResult:
    variant: str
    seed: int
    worst: float  # over the whole walk
    bound: float
    problem: str | None  # where the greedy token differed, or the positions or Engram history
    first_tie: int | None  # the first step whose reference met a top-k near-tie
    worst_before_tie: float  # what the bound applies to
    worst_after_tie: float  # what steps_walk.TIE_BOUND applies to
    tie_bound: float

    @property
    def broken(self) -> bool:
        return (self.worst_before_tie >= self.bound or self.worst_after_tie >= self.tie_bound
                or self.problem is not None)


def one_seed(variant: str, seed: int) -> SeedResult:
    """The walk of one seed of `variant`."""
    import torch

    from tests.build_engines.export.steps_walk import TIE_BOUND, logit_bound, walk_turns
    from tests.ced.model.test_engram import engram_network
    from tests.tiny import tiny_network

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    net = tiny_network() if variant == "plain" else engram_network()
    with tempfile.TemporaryDirectory() as work:
        walk = walk_turns(net, Path(work))
    problem = walk.other_token
    if not walk.positions_agree:
        problem = "positions differ"
    elif walk.engram_history_agrees is False:
        problem = "Engram history differs"
    return SeedResult(variant, seed, walk.worst, logit_bound(net.cfg), problem, walk.first_tie,
                      walk.worst_before_tie, walk.worst_after_tie, TIE_BOUND)


def table(results: list[SeedResult], seeds: range, seconds: float) -> str:
    from tests.build_engines.export.steps_walk import DECODE_STEPS, TURNS

    steps = len(TURNS) * (1 + DECODE_STEPS)  # compared per walk: a replay and the decode steps of each turn
    lines = [SECTION, "",
             f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {os.cpu_count()} cores "
             f"({seconds:.0f} s): seeds {seeds.start}-{seeds.stop - 1} of each variant, the walk of "
             "test_steps.py (4 turns, chunked prefill, replays under two adapters, 6 decode steps a turn).", "",
             "| variant | seeds | bound | worst before a near-tie | median | 99th percentile | worst seed | "
             "over the bound before a near-tie | walks with a near-tie | their median first step | worst after one "
             "(tie bound) | greedy token differed |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for variant in ("plain", "engram"):
        rows = [r for r in results if r.variant == variant]
        if not rows:
            continue
        checked = np.array([r.worst_before_tie for r in rows])
        bound = rows[0].bound
        top = max(rows, key=lambda r: r.worst_before_tie)
        tied = [r for r in rows if r.first_tie is not None]
        lines.append(f"| {variant} | {len(rows)} | {bound:.2e} | {checked.max():.2e} | {np.median(checked):.2e} | "
                     f"{np.percentile(checked, 99):.2e} | {top.seed} | {int((checked >= bound).sum())} | "
                     f"{len(tied)} | {np.median([r.first_tie for r in tied]) if tied else '-'} of {steps} | "
                     f"{max((r.worst_after_tie for r in tied), default=0.0):.2e} ({rows[0].tie_bound:.0e}) | "
                     f"{sum(r.problem is not None for r in rows)} |")
    over = sorted((r for r in results if r.worst >= r.bound), key=lambda r: (r.variant, r.seed))
    if over:
        lines += ["", "Walks over the bound anywhere: " + "; ".join(
            f"{r.variant} seed {r.seed}: {r.worst:.2e}, first near-tie at step {r.first_tie}" for r in over) + "."]
    lines += ["", "Replay one seed with `pytest tests/build_engines/export/test_steps.py --seed N -m ''`."]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=200)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--variants", nargs="+", default=["plain", "engram"], choices=["plain", "engram"])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "testing.md")
    p.add_argument("--force", action="store_true", help="rewrite this section of the committed --out file")
    args = p.parse_args()
    refuse_to_overwrite([args.out], args.force, "--out FILE")
    seeds = range(args.first, args.first + args.seeds)
    started = time.monotonic()
    jobs = [(v, s) for s in seeds for v in args.variants]
    results = []
    with ProcessPoolExecutor(args.workers) as pool:
        futures = [pool.submit(one_seed, v, s) for v, s in jobs]
        for future in tqdm(futures, desc="seeds", unit="walk"):
            results.append(future.result())
    text = table(results, seeds, time.monotonic() - started)
    print(text)
    write_section(args.out, text, SECTION, title="# Testing")
    broken = [r for r in results if r.broken]
    for r in broken:
        print(f"{r.variant} seed {r.seed}: worst {r.worst_before_tie:.2e} before its first near-tie (step "
              f"{r.first_tie}; bound {r.bound:.2e}), {r.worst_after_tie:.2e} after it (bound {r.tie_bound:.0e}) "
              f"{r.problem or ''}")
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
