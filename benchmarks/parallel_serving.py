"""The scripted conversation served by tensor-parallel roles against one process, side by side (issue 30).

    .venv/bin/python -m benchmarks parallel-serving [--tokens 32] [--rounds 2] [--out docs/parallel_serving.md]

For each layout (1 rank; TP = 2; TP = 2 with expert parallel) the serving library in process (`InProcessPipeline`, the
services the Triton models run) plays the main job's conversation (`scripts/run_main.py`: routed turns and an
explicit adapter) on the torch engine; a parallel layout's encoder and decoder each lead a group of ranks
(`tritonserver_backend.engines.rank_group`). Prints, and writes as a markdown table: whether every turn's tokens equal
the single-rank ones, wall time per conversation (best of --rounds, groups already started), the time to start the
groups, the weights each rank holds per role, and each worker rank's peak RSS (VmHWM). On this 2-core machine the
ranks share the cores, so the time column measures overhead (collectives, per-call broadcast), not a speed-up.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from benchmarks.harness import ROOT
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.clients.scripted import CONVERSATION
from tritonserver_backend.core.pipeline import InProcessPipeline
from tritonserver_backend.sampling.params import SamplingParams

MB = 1e6
LAYOUTS = [("1 rank", 1, False), ("TP = 2", 2, False), ("TP = 2 + EP", 2, True)]


def role_bytes(model: Path, world: int, rank: int, expert_parallel: bool) -> dict[str, int]:
    """Weight bytes one rank holds per role, in fp32 as the torch engine holds them (shapes only, no data)."""
    from build_engines.build.rank_build import ROLES, role_names
    from ced.formats.config_file import load_config
    from ced.parallel.layout import ParallelLayout

    cfg, layout = load_config(model), ParallelLayout(world, rank, expert_parallel)
    return {role: 4 * sum(math.prod(shape) for shape in role_names(cfg, layout, role).values()) for role in ROLES}


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / MB
    return float("nan")


def conversation(pipe: InProcessPipeline, session: str, tokens: int) -> list[list[int]]:
    return [list(pipe.chat(session, text, adapter=adapter, new_session=i == 0,
                           params=SamplingParams(max_tokens=tokens)).token_ids)
            for i, (adapter, text) in enumerate(CONVERSATION)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "embedded" / "mol2-small")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="markdown file for the table")
    a = p.parse_args(argv)
    rows, reference = [], None
    for name, world, ep in tqdm(LAYOUTS, desc="layouts"):
        root = Path(tempfile.mkdtemp(prefix="bench-parallel-"))
        ensure_registry(root, a.model)
        pipe = InProcessPipeline(a.model, root, max_context=4096, tensor_parallel_size=world, expert_parallel=ep)
        t0 = time.perf_counter()
        first = conversation(pipe, "warm", a.tokens)  # starts the groups (parallel) and warms the caches
        start_s = time.perf_counter() - t0
        times = []
        for r in range(a.rounds):
            t0 = time.perf_counter()
            got = conversation(pipe, f"round-{r}", a.tokens)
            times.append(time.perf_counter() - t0)
            assert got == first, "a rerun changed the tokens"
        reference = reference or first
        held = [role_bytes(a.model, world, rank, ep) for rank in range(world)]
        workers = {role: g.worker_pids() for role, g in getattr(pipe.engine, "groups", {}).items()}
        rss = {role: [peak_rss_mb(pid) for pid in pids] for role, pids in workers.items()}
        tokens = sum(len(t) for t in first)
        rows.append((name, first == reference, min(times), tokens, start_s, held, rss))
        if world > 1:
            pipe.engine.close()  # type: ignore[attr-defined]
    lines = [f"Scripted conversation ({len(CONVERSATION)} turns, up to {a.tokens} tokens each), torch engine, in "
             f"process; best of {a.rounds} rounds.", "",
             "| layout | tokens equal 1 rank | conversation s (tokens) | vs 1 rank | first conversation s (starts the "
             "groups) | held per rank, encoder / decoder | worker rank peak RSS, encoder / decoder |",
             "|---|---|---|---|---|---|---|"]
    base = rows[0][2]
    for name, equal, best, tokens, start_s, held, rss in rows:
        held_s = ", ".join(f"{h['encoder'] / MB:.1f} / {h['decoder'] / MB:.1f} MB" for h in held)
        rss_s = ", ".join(f"{e:.0f} / {d:.0f} MB"
                          for e, d in zip(rss.get("encoder", []), rss.get("decoder", []))) or "-"
        lines.append(f"| {name} | {'yes' if equal else 'NO'} | {best:.2f} ({tokens}) | {best / base:.2f}x | "
                     f"{start_s:.1f} | {held_s} | {rss_s} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0 if all(r[1] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
