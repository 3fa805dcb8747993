"""Start, inspect and stop a loopback NVIDIA Dynamo deployment of the embedded default (docs/scale_out.md).

  .venv/bin/python scripts/dynamo_up.py start --encoders 2 --decoders 2 --port 18080   # returns once it serves
  curl -s 127.0.0.1:18080/v1/chat/completions -H 'x-dynamo-session-id: s1' -H 'content-type: application/json' \\
       -d '{"model": "mol2-small", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 24,
            "nvext": {"extra_fields": ["engine_data"]}}'
       # -> nvext.engine_data.mol2_session_token: later turns of s1 send "annotations": ["mol2-session-token:<token>"]
       #    in nvext
  .venv/bin/python scripts/dynamo_up.py status      # per worker: routing, transfers, refused session checks, drafting
  .venv/bin/python scripts/dynamo_up.py stop

Discovery is Dynamo's file backend under --run-dir (no etcd, no NATS); the workers run in .venv-dynamo
(scripts/setup_dynamo.sh).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dynamo_deploy.launcher import Deployment, counter_totals, read_stats, stop_recorded
from dynamo_deploy.worker_common import add_speculative_arguments
from tritonserver_backend.core.counters import DRAFTED, DRAFTS_ACCEPTED, SPECULATIVE_BLOCKS, TOKEN_REFUSALS
from tritonserver_backend.repository import parallel_backend

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_RUN_DIR = ROOT / "artifacts" / "dynamo"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["start", "status", "stop"])
    p.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR)
    p.add_argument("--encoders", type=int, default=1)
    p.add_argument("--decoders", type=int, default=1)
    p.add_argument("--port", type=int, default=18080)
    p.add_argument("--model-dir", type=Path, default=ROOT / "embedded" / "mol2-small")
    p.add_argument("--engine-dir", type=Path, default=ROOT / "artifacts" / "engines" / "mol2-small")
    p.add_argument("--backend", default=None, choices=["onnx", "torch"],
                   help="default onnx; torch with --tensor-parallel-size above 1")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="each encoder and decoder worker runs its role on N ranks it starts and leads "
                   "(docs/parallel.md)")
    p.add_argument("--enable-expert-parallel", action="store_true", help="place routed experts whole over those ranks")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--nixl-threshold-bytes", type=int, default=0,
                   help="hand-overs from this size move through NIXL (e.g. 4194304); 0 (default): NIXL off, all inline")
    p.add_argument("--no-session-auth", dest="session_auth", action="store_false",
                   help="no session tokens: any client that sends a session id continues that conversation (a trusted "
                        "single-tenant deployment only; the workers' calls to each other stay signed)")
    add_speculative_arguments(p)
    a = p.parse_args(argv)
    try:
        a.backend = parallel_backend(a.backend, a.tensor_parallel_size, a.enable_expert_parallel)
    except ValueError as exc:
        p.error(str(exc))
    if a.command == "start":
        if (a.run_dir / "deployment.json").exists():
            print(f"a deployment is already recorded in {a.run_dir}; stop it first", file=sys.stderr)
            return 1
        d = Deployment(a.run_dir, a.model_dir, a.engine_dir, a.encoders, a.decoders, a.port, a.backend, a.max_context,
                       nixl_threshold_bytes=a.nixl_threshold_bytes, session_auth=a.session_auth,
                       tensor_parallel_size=a.tensor_parallel_size, expert_parallel=a.enable_expert_parallel,
                       speculative=a.speculative, speculative_block=a.speculative_block,
                       speculative_confidence=a.speculative_confidence, speculative_batch=a.speculative_batch)
        t0 = time.monotonic()
        print(f"starting {a.encoders} encoder + {a.decoders} decoder workers and the frontend (logs in "
              f"{a.run_dir / 'logs'}) ...", flush=True)
        try:
            d.start()
        except BaseException:
            d.stop()
            raise
        print(f"serving {d.url}/v1/chat/completions (model mol2-small) after {time.monotonic() - t0:.1f} s")
        return 0
    if a.command == "status":
        for name, w in read_stats(a.run_dir).items():
            c = w["counters"]
            show = {k.split("/")[0].replace("routing_decisions_", ""): 0 for k in c
                    if k.startswith("routing_decisions")}
            for k, v in c.items():
                if k.startswith("routing_decisions"):
                    show[k.split("/")[0].replace("routing_decisions_", "")] += v
            f = w["figures"]
            refused = {k.split("/", 1)[1]: v for k, v in sorted(c.items()) if k.startswith(TOKEN_REFUSALS + "/")}
            totals = counter_totals([w], (SPECULATIVE_BLOCKS, DRAFTED, DRAFTS_ACCEPTED))
            drafted = dict(zip(("blocks", "drafted", "accepted"), map(int, totals.values())))
            print(f"{name:10s} instance {w['instance_id']} pid {w['pid']}: turns {int(f.get('turns', 0))}, routing "
                  f"{show}, hand-over {int(f.get('handover_turn_bytes', 0))} B in {int(f.get('handover_turns', 0))} "
                  f"turns (inline {int(f.get('sent_inline_bytes', 0) + f.get('received_inline_bytes', 0))} B, NIXL "
                  f"{int(f.get('sent_nixl_bytes', 0) + f.get('received_nixl_bytes', 0))} B), steps "
                  f"{int(f.get('step_calls', 0))} ({int(f.get('step_bytes', 0))} B), rebuilds "
                  f"{int(f.get('rebuilds', 0))}, refused session checks {refused}"
                  + (f", speculative {drafted}" if w["role"] == "decoder" else ""))
        return 0
    stopped = stop_recorded(a.run_dir)
    print(f"stopped {', '.join(stopped) if stopped else 'nothing (no deployment recorded)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
