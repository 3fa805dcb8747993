"""Faults and healing: each Python-backend model's process (and tritonserver itself) SIGKILLed while a turn streams,
on a supervised server holding open sessions; per fault, the seconds to the stream's error, to not-ready and to
healed, and the sessions kept (their next turn equal, token for token, to the never-stopped pipeline's).

    .venv/bin/python -m benchmarks faults [--sessions 4] [--models encoder decoder ...] [--out docs/reliability.md]

A real tritonserver on the embedded default's onnx engines under `tritonserver_backend.launcher.supervisor`, with the
session journal on; one more server with the journal off (`session_dir: off`) takes the decoder's fault too, side by
side, to show what the journal keeps. Conversations are mirrored on the in-process pipeline (benchmarks/
fault_drill.py): a session counts as kept when its next turn (the killed one retried, for its session) is answered
and equals the pipeline's reply.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.fault_drill import MirroredConversations, kill_mid_stream, start_supervised, stub_pid
from benchmarks.harness import (
    DEFAULT_ENGINES,
    EMBEDDED,
    ROOT,
    default_params,
    ensure_engines,
    refuse_to_overwrite,
    write_section,
)
from tritonserver_backend import contract as c
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.core.pipeline import InProcessPipeline
from tritonserver_backend.launcher.restart_policy import RestartPolicy
from tritonserver_backend.launcher.supervisor import Supervisor

SECTION = "## Measured: faults and healing (benchmarks/faults.py)"
MODELS = [m.name for m in c.MODELS if m.name != c.ENSEMBLE_NAME]
SERVER = "tritonserver"


@dataclass
class FaultRow:
    fault: str
    journal: bool
    error_s: float | None
    not_ready_s: float | None
    healed_s: float | None
    kept: int
    open: int
    regions_left: int


def _supervised(work: Path, journal: bool, faults: int) -> Supervisor:
    params = default_params(registry_root=str(work / "registry"), max_context="2048")
    if not journal:
        params["session_dir"] = "off"
    return start_supervised(work, params, RestartPolicy(max_restarts=faults + 2, delays=(0.0,)))


def drill(work: Path, faults: list[str], sessions: int, journal: bool) -> list[FaultRow]:
    """One supervised server; `sessions` conversations of two turns, then each fault in turn on a streaming turn of
    one of them, and every session's next turn after healing."""
    root = work / "reference"
    ensure_registry(root, EMBEDDED)
    reference = InProcessPipeline(EMBEDDED, root, max_context=2048, backend="onnx", engine_dir=DEFAULT_ENGINES)
    sup = _supervised(work, journal, len(faults))
    rows = []
    try:
        if sup.server is None:
            raise RuntimeError("the supervised server did not start")
        talk = MirroredConversations(sup.server.grpc_url, reference)
        names = [f"s{i}" for i in range(sessions)]
        for name in names:
            for new in (True, False):
                if not talk.turn(talk.request(name, new=new)).equal:
                    raise RuntimeError(f"{name}: the server and the pipeline disagree before any fault: void run")
        for i, fault in enumerate(faults):
            killed = names[i % sessions]
            request = talk.request(killed, long=True)
            pid = sup.server.pid if fault == SERVER else stub_pid(sup, fault)
            timings = kill_mid_stream(sup, talk, request, pid or 0)
            kept = int(talk.turn(request).equal)  # the killed turn, retried
            kept += sum(talk.turn(talk.request(n)).equal for n in names if n != killed)
            rows.append(FaultRow(fault, journal, timings.error, timings.not_ready, timings.healed, kept, sessions,
                                 len(timings.regions_left)))
            print(f"{fault:16s} journal {'on ' if journal else 'off'}: error {_s(timings.error)}, not ready "
                  f"{_s(timings.not_ready)}, healed {_s(timings.healed)}, sessions kept {kept}/{sessions}", flush=True)
            if not journal:  # the sessions are gone: start them again for the next fault
                for name in names:
                    talk.turn(talk.request(name, new=True))
    finally:
        sup.stop()
    return rows


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def render(args: argparse.Namespace, rows: list[FaultRow]) -> str:
    lines = [SECTION, "",
             f"`.venv/bin/python -m benchmarks faults --sessions {args.sessions} --models {' '.join(args.models)}` "
             f"({time.strftime('%Y-%m-%d')}; the embedded default on its onnx engines, a real tritonserver under the "
             "supervisor, 2-core machine). Each fault is a SIGKILL while one session's turn streams (160 tokens); "
             "times run from the kill. The drill's restart policy has no back-off delay, so that each row times one "
             "restart (the default policy waits 0, 2, 5, 10, 20 s before the 1st..5th restart within 10 minutes). "
             "*Kept*: sessions whose next turn (the killed turn retried, for its session) equals the never-stopped "
             "in-process pipeline's reply, token for token.", "",
             "| fault (SIGKILL of) | journal | stream error | not ready | healed | sessions kept / open | "
             "shm regions left |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.fault} | {'on' if r.journal else 'off'} | {_s(r.error_s)} | {_s(r.not_ready_s)} | "
                     f"{_s(r.healed_s)} | {r.kept} / {r.open} | {r.regions_left} |")
    healed = [r.healed_s for r in rows if r.journal and r.healed_s is not None]
    errors = [r.error_s for r in rows if r.error_s is not None]
    if healed and errors:
        lines += ["", f"Healed after {min(healed):.1f}-{max(healed):.1f} s: the whole server restarts and its models "
                  f"load again. The open stream's error came {min(errors):.1f}-{max(errors):.1f} s after the kill: "
                  "as soon as the supervisor began to stop the server, or at its SIGKILL 2 s later (the supervisor's "
                  "grace) when the dead model was one the stream was waiting on (the encoder or the decoder), whose "
                  "hung requests keep Triton from exiting on SIGTERM."]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--models", nargs="+", default=[*MODELS, SERVER], choices=[*MODELS, SERVER])
    p.add_argument("--no-contrast", action="store_true", help="skip the journal-off server (the decoder's fault)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "reliability.md")
    p.add_argument("--work", type=Path, default=None, help="work folder (default: a temporary one)")
    p.add_argument("--force", action="store_true", help="overwrite the committed --out file")
    args = p.parse_args()
    refuse_to_overwrite([args.out], args.force, "--out FILE")
    ensure_engines()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        rows = drill(work / "journal-on", args.models, args.sessions, journal=True)
        if not args.no_contrast:
            rows += drill(work / "journal-off", ["decoder"], args.sessions, journal=False)
    text = render(args, rows)
    write_section(args.out, text, SECTION, title="# Reliability: faults, healing and sessions that survive them")
    print(text)
    return 0
