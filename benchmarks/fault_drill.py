"""Fault drills on a supervised tritonserver: conversations mirrored on the never-stopped in-process pipeline, and a
model process SIGKILLed while a turn streams, timed from the kill to the stream's error, to the supervisor's
not-ready and to serving again. Shared by `python -m benchmarks faults` and tests/tritonserver_backend/
test_fault_healing.py, so the figures in docs/reliability.md and the tests' bounds come from one procedure."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tritonserver_backend.clients.client import GrpcChat, Reply, SessionTokens, TurnRequest
from tritonserver_backend.core.pipeline import InProcessPipeline
from tritonserver_backend.launcher.restart_policy import RestartPolicy
from tritonserver_backend.launcher.supervisor import Supervisor, model_of
from tritonserver_backend.sampling.sampler import SamplingParams

TEXTS = ["Tell me about ships.", "How do I center a div?", "def f(x): return x", "git status?"]


def probe_status(url: str) -> int:
    """The HTTP status `url` answers (0: nothing listens)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


@dataclass
class Exchange:
    """One turn as the server answered it and as the never-stopped pipeline answers the same conversation."""

    reply: Reply
    expected: Any  # the pipeline's TurnResult (None when the server refused the turn)

    @property
    def equal(self) -> bool:
        return (self.reply.error is None and self.expected is not None
                and self.reply.token_ids == self.expected.token_ids and self.reply.adapter == self.expected.adapter)


class MirroredConversations:
    """Sessions held on the server and, turn for turn, in the in-process pipeline, which never dies: a resumed
    session is right when its reply equals the pipeline's (greedy)."""

    def __init__(self, grpc_url: str, reference: InProcessPipeline) -> None:
        self.url, self.reference, self.tokens, self.turns = grpc_url, reference, SessionTokens(), 0

    def request(self, session: str, new: bool = False, long: bool = False) -> TurnRequest:
        self.turns += 1
        if long:  # a turn still streaming when its model is killed
            return TurnRequest(session, "Tell me a very long story.", max_tokens=160, ignore_eos=True)
        return TurnRequest(session, f"{TEXTS[self.turns % len(TEXTS)]} ({self.turns})", new_session=new,
                           max_tokens=6)

    def turn(self, r: TurnRequest) -> Exchange:
        """Send on a fresh stream (a dead server's stream is gone); mirror it on the pipeline only when the server
        took it, so the two conversations stay the same."""
        chat = GrpcChat(self.url, self.tokens)
        try:
            reply = chat.turn(r, timeout=120)
        finally:
            chat.close()
        if reply.error is not None:
            return Exchange(reply, None)
        params = SamplingParams(max_tokens=r.max_tokens or 16, ignore_eos=r.ignore_eos)
        expected = self.reference.chat(r.session_id, r.text, r.adapter, r.new_session, r.history, params)
        return Exchange(reply, expected)


def start_supervised(work: Path, params: dict[str, str], policy: RestartPolicy | None = None,
                     ports: dict[str, int] | None = None) -> Supervisor:
    """A supervised tritonserver on a repository rendered from `params` into `work/repo` (server in `work/server`,
    so its session journal is `work/server/sessions`), started in a thread and ready. `ports` (http_port,
    grpc_port, metrics_port): where a restarted deployment must listen again."""
    from tritonserver_backend.launcher import TritonServer
    from tritonserver_backend.repository import build_repository

    repo = build_repository(work / "repo", params)
    sup = Supervisor(lambda: TritonServer(work_dir=work / "server"), dict(model_repository=repo, **(ports or {})),
                     policy=policy, state_file=work / "supervisor.json")
    sup.start_thread()
    try:
        sup.wait_state("ready", timeout=300)
    except BaseException:
        sup.stop()
        raise
    return sup


def stub_pid(sup: Supervisor, model: str) -> int:
    """The PID of `model`'s Python-backend stub in the supervised server."""
    record = sup.server.snapshot() if sup.server is not None else None
    pids = [s.pid for s in (record.stubs if record is not None else []) if model_of(s) == model]
    if len(pids) != 1:
        raise RuntimeError(f"{model}: expected one stub, found {pids}")
    return pids[0]


@dataclass
class FaultTimings:
    """Seconds from the kill to each event (None: it did not happen within the drill's bound)."""

    error: float | None = None  # the open stream ended with an error
    not_ready: float | None = None  # the supervisor's /health/ready answered 503
    healed: float | None = None  # the supervisor was ready again (and /health/ready 200)
    live_held: bool = True  # /health/live answered 200 whenever it was asked while healing
    reply: Reply | None = None  # what the killed stream got
    regions_left: list[str] = field(default_factory=list)  # shared-memory regions of the dead server still there


def kill_mid_stream(sup: Supervisor, talk: MirroredConversations, request: TurnRequest, pid: int,
                    bound_s: float = 90.0) -> FaultTimings:
    """Stream `request`, SIGKILL `pid` (a stub, or tritonserver itself) once tokens flow, and time what follows."""
    if sup.probe is None or sup.server is None:
        raise RuntimeError("the drill needs a supervisor with its health probe and a running server")
    probe = sup.probe.url
    faults_before = len(sup.faults)
    record = sup.server.snapshot()
    regions = set(record.regions()) if record is not None else set()
    chat = GrpcChat(talk.url, talk.tokens)
    flowing, ended = threading.Event(), threading.Event()
    timings = FaultTimings()

    def stream() -> None:
        try:
            timings.reply = chat.turn(request, timeout=bound_s, on_piece=lambda _: flowing.set())
        finally:
            ended.set()

    threading.Thread(target=stream, daemon=True).start()
    if not flowing.wait(60):
        raise RuntimeError("the long turn never streamed a token")
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    # until the stream has ended, the probe has said 503 and the supervisor has recorded the fault (a dead
    # tritonserver makes Triton unready before the supervisor's next poll)
    while timings.not_ready is None or timings.error is None or len(sup.faults) == faults_before:
        now = time.monotonic() - killed
        if timings.not_ready is None and probe_status(f"{probe}/health/ready") == 503:
            timings.not_ready = now
            timings.live_held = probe_status(f"{probe}/health/live") == 200
        if timings.error is None and ended.is_set():
            timings.error = now
        if now > bound_s:
            break
        time.sleep(0.05)
    chat.close()
    try:
        sup.wait_state("ready", timeout=max(1.0, bound_s - (time.monotonic() - killed)))
        if probe_status(f"{probe}/health/ready") == 200:
            timings.healed = time.monotonic() - killed
    except TimeoutError:
        pass
    timings.regions_left = sorted(str(r) for r in regions if Path(r).exists())
    return timings
