"""A worker rank (1..N-1) of a tensor-parallel encoder or decoder: `python -m tritonserver_backend.engines.rank_worker`.

Started by the leader (`rank_group.RankGroup`), never by hand. It joins the gloo group, loads its shard of the role,
then for each line the leader writes to its stdin takes part in one broadcast call: a step or a new adapter bank.
End of file on stdin (the leader closed it or died) ends it; so does the leader's death seen any other way.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path


def _die_with_leader(leader_pid: int) -> None:
    """Exit as soon as the process that started us is gone (we are re-parented). Not PR_SET_PDEATHSIG: it fires when
    the *thread* that spawned us exits, and a leader starts its group from whichever worker thread made the first
    call, a thread that may end long before the leader."""
    def watch() -> None:
        while os.getppid() == leader_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="leader-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--role", choices=("encoder", "decoder"), required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--leader-pid", type=int, required=True)
    parser.add_argument("--expert-parallel", action="store_true")
    parser.add_argument("--rank-files", type=Path, default=None, help="a rank-local build to read the weights from")
    args = parser.parse_args(argv)
    _die_with_leader(args.leader_pid)

    import torch

    from ced.parallel.comm import Comm, barrier, broadcast_object, open_group
    from tritonserver_backend.engines.shard_steps import ShardSteps

    torch.set_num_threads(args.threads)
    group = open_group(args.port, args.rank, args.world, args.timeout_s)
    steps = ShardSteps(args.model_dir, args.role, Comm(group), args.expert_parallel, args.rank_files)
    print(f"rank {args.rank} of {args.world} ({args.role}): {steps.held_bytes / 1e6:.1f} MB of weights", flush=True)
    barrier(group)
    for _ in sys.stdin.buffer:  # one line per call; no timeout while the server idles
        op, payload = broadcast_object(group)
        if op == "bank":
            steps.set_bank(payload)
        else:
            steps.step(payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
