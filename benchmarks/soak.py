"""A bounded load-and-fault run against a real tritonserver on loopback; exits non-zero on any failure it finds.

    .venv/bin/python -m benchmarks soak [--duration 600] [--clients 32] [--out docs/load.md] [--no-doc]

Clients (one gRPC stream each) loop over: multi-turn conversations mixing routed and explicit turns, new and ended
sessions; streams dropped mid-reply (most call `session_control` "cancel" as a client should, some just vanish);
bad requests of every kind (unknown adapter, unknown or ended session, over-long input, bad sampling values, bad
history, a tensor of the wrong type); meanwhile an admin thread loads, updates and unloads an extra adapter through
`adapter_admin`, and a control client replays a fixed conversation whose greedy replies must equal the ones the idle
server gave before the load began. Reported: server crashes (must be 0), unexpected errors (must be 0), turns,
tokens/s, time to first token and inter-token latency p50/p99, the routing counters (written = read, read = applied
+ rejected), control-session equality. Results and a latency plot go into docs/load.md unless --no-doc.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.harness import ROOT, default_params, ensure_engines, refuse_to_overwrite, served, write_section
from tritonserver_backend.clients.client import GrpcChat, SessionTokens, TurnRequest, cancel_turn, raw_stream_error
from tritonserver_backend.launcher import TritonServer

SECTION = "## Soak (benchmarks/soak.py)"
TEXTS = ["Hi there, how are you?", "def add(a, b):\n    return a + b", "Center a div with flexbox, please.",
         "tar -xzf archive.tgz -C /tmp", "What should I cook tonight?", "ls -la | grep conf",
         "import json\nprint(json.dumps({'a': 1}))", ".nav a:hover { color: teal; }"]
ADAPTERS = [None, None, None, "L0_chat", "L1_agent", "L2_code", "L3_design", "base"]
CONTROL = [("Hello! What's new?", None), ("import os\nprint(os.getcwd())", None), ("Thanks a lot.", "L0_chat")]
EXPECTED = ("server busy", "unknown adapter", "unknown session", "no live session", "was ended", "context limit",
            "max_tokens must lie in", "history is not valid JSON", "temperature must lie in", "top_p must lie in",
            "cancelled before it started", "is not loaded", "still answering")


@dataclass
class Stats:
    lock: threading.Lock = field(default_factory=threading.Lock)
    turns: int = 0
    tokens: int = 0
    cancelled: int = 0
    abrupt: int = 0
    bad_requests: int = 0
    expected_errors: dict[str, int] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    control_runs: int = 0
    control_mismatches: list[str] = field(default_factory=list)
    admin_actions: int = 0
    timeline: list[tuple[float, int]] = field(default_factory=list)

    def error(self, where: str, message: str) -> None:
        with self.lock:
            kind = next((e for e in EXPECTED if e in message), None)
            if kind is None:
                self.unexpected.append(f"{where}: {message[:300]}")
            else:
                self.expected_errors[kind] = self.expected_errors.get(kind, 0) + 1


class TimedChat:
    """A GrpcChat whose turns record time to first token and the gaps between tokens."""

    def __init__(self, url: str, stats: Stats) -> None:
        self.url, self.stats = url, stats
        self.tokens = SessionTokens()  # kept across reopened streams: the sessions outlive them
        self.chat = GrpcChat(url, self.tokens)

    def turn(self, request: TurnRequest, stop_after: int | None = None):  # type: ignore[no-untyped-def]
        stamps: list[float] = []
        start = time.perf_counter()

        def on_piece(_: str) -> None:
            stamps.append(time.perf_counter())
            if stop_after is not None and len(stamps) == stop_after:
                threading.Thread(target=self.chat.client.stop_stream, kwargs={"cancel_requests": True}).start()

        try:
            reply = self.chat.turn(request, timeout=300, on_piece=on_piece)
        except Exception as exc:  # noqa: BLE001 - a dropped stream ends the turn on our side
            reply = None
            if stop_after is None:
                raise RuntimeError(f"stream failed: {exc}") from exc
        with self.stats.lock:
            if stamps:
                self.stats.ttft.append(stamps[0] - start)
                self.stats.itl.extend(b - a for a, b in zip(stamps, stamps[1:]))
                self.stats.tokens += len(stamps)
                self.stats.timeline.append((time.time(), len(stamps)))
        return reply

    def reopen(self) -> None:
        try:
            self.chat.close()
        except Exception:  # noqa: BLE001 - the stream is already gone
            pass
        self.chat = GrpcChat(self.url, self.tokens)

    def close(self) -> None:
        self.reopen()
        self.chat.close()


def conversation(chat: TimedChat, sid: str, rng: random.Random, stats: Stats) -> None:
    turns = rng.randint(1, 4)
    for t in range(turns):
        request = TurnRequest(sid, rng.choice(TEXTS), new_session=t == 0, adapter=rng.choice(ADAPTERS),
                              max_tokens=rng.randint(4, 40), end_session=t == turns - 1 and rng.random() < 0.5)
        reply = chat.turn(request)
        if reply.error:
            stats.error(f"{sid} turn {t}", reply.error)
            if "server busy" in reply.error or t == 0:
                return
            continue
        with stats.lock:
            stats.turns += 1
        if request.end_session:
            after = chat.turn(TurnRequest(sid, "still there?", max_tokens=4))
            if not (after.error and "was ended" in after.error):
                stats.error(f"{sid} after end", f"an ended session answered: {after}")
            else:
                stats.error(f"{sid} after end", after.error)


def disconnect(chat: TimedChat, sid: str, rng: random.Random, stats: Stats, http_url: str) -> None:
    """A stream dropped mid-reply; a polite client then cancels its turn, an abrupt one just goes away."""
    polite = rng.random() < 0.7
    chat.turn(TurnRequest(sid, rng.choice(TEXTS), new_session=True, max_tokens=120 if polite else 48),
              stop_after=rng.randint(1, 6))
    chat.reopen()
    with stats.lock:
        stats.cancelled += polite
        stats.abrupt += not polite
    if polite:
        try:
            cancel_turn(http_url, sid, chat.tokens.get(sid))
        except RuntimeError as exc:
            stats.error(f"{sid} cancel", str(exc))


def bad_request(chat: TimedChat, rng: random.Random, stats: Stats, server: TritonServer) -> None:
    cases = [
        TurnRequest("soak-missing-session", "hello", max_tokens=4),
        TurnRequest(f"bad-{rng.random()}", "hello", new_session=True, adapter="no_such_adapter", max_tokens=4),
        TurnRequest(f"bad-{rng.random()}", "word " * 5000, new_session=True, max_tokens=4),
        TurnRequest(f"bad-{rng.random()}", "hello", new_session=True, max_tokens=-1),
        TurnRequest(f"bad-{rng.random()}", "hello", new_session=True, temperature=-2.0),
        TurnRequest(f"bad-{rng.random()}", "hello", history="[oops", max_tokens=4),
    ]
    with stats.lock:
        stats.bad_requests += 1
    if rng.random() < 0.2:
        message = wrong_type_request(server)
        if message is None or "max_tokens" not in message:
            stats.error("wrong-type tensor", f"expected a dtype error, got {message!r}")
        return
    reply = chat.turn(rng.choice(cases))
    if reply.error is None:
        stats.error("bad request", f"a bad request was answered: {reply}")
    else:
        stats.error("bad request", reply.error)


def wrong_type_request(server: TritonServer) -> str | None:
    """max_tokens sent as FP32 on a raw stream: must come back as a clear error."""
    return raw_stream_error(server.grpc_url, [("session_id", np.array([b"x"], dtype=np.object_), "BYTES"),
                                              ("text", np.array([b"x"], dtype=np.object_), "BYTES"),
                                              ("max_tokens", np.array([3.0], dtype=np.float32), "FP32")])


def admin(server: TritonServer, registry: Path, stop: threading.Event, stats: Stats) -> None:
    """Load, update (a new weights file at the same path) and unload an extra adapter, over and over."""
    import tritonclient.http as httpclient

    from tritonserver_backend.auth.admin_auth import admin_headers

    sources = [registry / "adapters" / name for name in ("L1_agent", "L2_code")]
    target = registry / "adapters" / "churn"
    client = httpclient.InferenceServerClient(server.http_url)
    headers = admin_headers(registry)  # the admin key (mol2-admin-key header) the server created under its registry

    def call(**inputs: str) -> None:
        tensors = []
        for name, value in inputs.items():
            inp = httpclient.InferInput(name, [1], "BYTES")
            inp.set_data_from_numpy(np.array([value.encode()], dtype=np.object_))
            tensors.append(inp)
        client.infer("adapter_admin", tensors, headers=dict(headers))  # a copy: the http client adds its own entries
        with stats.lock:
            stats.admin_actions += 1

    version = 0
    while not stop.wait(1.5):
        try:
            shutil.copytree(sources[version % 2], target, dirs_exist_ok=True)
            version += 1
            call(action="load", adapter="churn", path="adapters/churn",
                 description="a churning adapter for the soak run")
            if stop.wait(1.5):
                break
            call(action="unload", adapter="churn")
        except Exception as exc:  # noqa: BLE001
            stats.error("admin", str(exc))
    client.close()


def control_conversation(chat: GrpcChat, sid: str) -> list[list[int]]:
    replies = []
    for i, (text, adapter) in enumerate(CONTROL):
        reply = chat.turn(TurnRequest(sid, text, new_session=i == 0, adapter=adapter, max_tokens=16), timeout=300)
        if reply.error:
            raise RuntimeError(f"control turn {i}: {reply.error}")
        replies.append(reply.token_ids)
    return replies


def metric_totals(server: TritonServer) -> dict[str, float]:
    totals: dict[str, float] = {}
    for line in urllib.request.urlopen(server.metrics_url).read().decode().splitlines():
        if line.startswith("mol2_"):
            name = line.split("{")[0]
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=ROOT / "artifacts" / "soak")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "load.md")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "figures" / "soak_latency.png")
    p.add_argument("--no-doc", action="store_true", help="report on stdout only (CI)")
    p.add_argument("--force", action="store_true",
                   help="overwrite the committed --out file and --plot (docs/load.md, docs/figures/)")
    args = p.parse_args()
    if not args.no_doc:
        refuse_to_overwrite([args.out, args.plot], args.force, "--out FILE --plot FILE, or --no-doc")
    ensure_engines()
    if args.work.exists():
        shutil.rmtree(args.work)
    registry = args.work / "registry"
    params = default_params(registry_root=str(registry), max_active_turns="32", max_queued_turns="32",
                            max_context="4096")
    stats = Stats()
    with served(args.work, params) as server:
        print(f"server ready after {server.ready_seconds:.1f} s; {args.clients} clients for {args.duration:.0f} s",
              flush=True)
        idle = GrpcChat(server.grpc_url)
        reference = control_conversation(idle, "control-idle")
        idle.close()
        stop = threading.Event()
        deadline = time.monotonic() + args.duration
        started = time.time()

        def client(index: int) -> None:
            rng = random.Random(args.seed * 1000 + index)
            chat = TimedChat(server.grpc_url, stats)
            n = 0
            while time.monotonic() < deadline:
                n += 1
                sid = f"c{index}-{n}"
                roll = rng.random()
                try:
                    if roll < 0.70:
                        conversation(chat, sid, rng, stats)
                    elif roll < 0.85:
                        disconnect(chat, sid, rng, stats, server.http_url)
                    else:
                        bad_request(chat, rng, stats, server)
                except Exception as exc:  # noqa: BLE001
                    stats.error(sid, f"{type(exc).__name__}: {exc}")
                    chat.reopen()
            chat.close()

        def control() -> None:
            chat = GrpcChat(server.grpc_url)
            n = 0
            while time.monotonic() < deadline:
                n += 1
                try:
                    got = control_conversation(chat, f"control-{n}")
                except Exception as exc:  # noqa: BLE001
                    stats.error("control", str(exc))
                    time.sleep(1)
                    continue
                with stats.lock:
                    stats.control_runs += 1
                    if got != reference:
                        stats.control_mismatches.append(f"control-{n}")
            chat.close()

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        threads += [threading.Thread(target=control, daemon=True),
                    threading.Thread(target=admin, args=(server, registry, stop, stats), daemon=True)]
        for t in threads:
            t.start()
        while time.monotonic() < deadline and server.is_running():
            time.sleep(1.0)
        for t in threads[:-1]:
            t.join(timeout=300)
        stop.set()
        threads[-1].join(timeout=30)
        wall = time.time() - started
        time.sleep(2.0)  # abrupt clients' turns run out; the server goes idle
        alive = server.is_running()
        log = Path(server.log_file).read_text(errors="replace") if server.log_file else ""
        crashes = int(not alive) + log.count("Signal (11)") + log.count("lock_exception")
        totals = metric_totals(server) if alive else {}
    written = totals.get("mol2_routing_decisions_written", 0)
    read = totals.get("mol2_routing_decisions_read", 0)
    applied, rejected = (totals.get("mol2_routing_decisions_applied", 0),
                         totals.get("mol2_routing_decisions_rejected", 0))
    counters_ok = bool(totals) and written == read == applied + rejected
    report = {
        "duration_s": round(wall, 1), "clients": args.clients, "server_crashes": crashes,
        "unexpected_errors": len(stats.unexpected),
        "turns_completed": stats.turns, "tokens": stats.tokens, "tokens_per_s": round(stats.tokens / wall, 1),
        "ttft_ms_p50": round(percentile(stats.ttft, 50) * 1e3, 1),
        "ttft_ms_p99": round(percentile(stats.ttft, 99) * 1e3, 1),
        "itl_ms_p50": round(percentile(stats.itl, 50) * 1e3, 2),
        "itl_ms_p99": round(percentile(stats.itl, 99) * 1e3, 2),
        "cancelled_streams": stats.cancelled, "abrupt_disconnects": stats.abrupt, "bad_requests": stats.bad_requests,
        "expected_errors": stats.expected_errors, "admin_actions": stats.admin_actions,
        "counters": {"written": written, "read": read, "applied": applied, "rejected": rejected, "ok": counters_ok},
        "control_runs": stats.control_runs, "control_identical": stats.control_runs - len(stats.control_mismatches),
    }
    print(json.dumps(report, indent=2))
    for line in stats.unexpected[:20]:
        print("UNEXPECTED:", line)
    ok = (crashes == 0 and not stats.unexpected and not stats.control_mismatches and stats.control_runs > 0
          and counters_ok)
    if not args.no_doc:
        write_doc(args, report, stats)
    print("soak:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def write_doc(args: argparse.Namespace, report: dict, stats: Stats) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.hist(np.array(stats.ttft) * 1e3, bins=50)
    a.set_xlabel("time to first token (ms)")
    a.set_ylabel("turns")
    b.hist(np.clip(np.array(stats.itl) * 1e3, 0, 200), bins=80)
    b.set_xlabel("inter-token latency (ms, clipped at 200)")
    b.set_ylabel("tokens")
    fig.suptitle(f"soak: {report['clients']} clients, {report['duration_s']:.0f} s")
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    lines = [SECTION, "",
             f"`.venv/bin/python -m benchmarks soak --duration {args.duration:.0f} --clients {args.clients}` "
             f"({time.strftime('%Y-%m-%d')}; onnx engines; 2-core CPU machine, the clients on the same cores):", "",
             "| measure | value |", "|---|---|"]
    for key, value in report.items():
        lines.append(f"| {key} | {value} |")
    lines += ["", f"![latency]({args.plot.relative_to(args.out.parent).as_posix()})", ""]
    write_section(args.out, "\n".join(lines), SECTION)


if __name__ == "__main__":
    sys.exit(main())
