"""Measure the hand-over on a loopback deployment: bytes and time per turn (the new turn's rows, encoder -> decoder)
and per generated token (the decoder's step call to the encoder: one token in, one row out), against the size of a
full decoder-state transfer at the same context; then the hand-over of a rebuild (the whole conversation resent under
new session ids, every position from 0) by the transport the threshold picks. Prints markdown for docs/scale_out.md.

  .venv/bin/python -m dynamo_deploy.measure [--turns 6 --tokens 32 --nixl-threshold-bytes 4194304]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from ced.steps.rows import DecoderRow
from dynamo_deploy.client import Conversation
from dynamo_deploy.launcher import PROJECT_ROOT, Deployment, read_turns

TEXTS = ["Hi! How was your day?", "def mean(xs):\n    return sum(xs) / len(xs)",
         "Make the header sticky with a shadow.", "git log --oneline shows nothing, why?",
         "Can you explain that again, more slowly please?", "Thanks, that helps."]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--port", type=int, default=18095)
    p.add_argument("--nixl-threshold-bytes", type=int, default=0)
    p.add_argument("--rebuilds", type=int, default=5)
    a = p.parse_args(argv)
    model = PROJECT_ROOT / "embedded" / "mol2-small"
    with tempfile.TemporaryDirectory() as tmp:
        d = Deployment(Path(tmp), model, PROJECT_ROOT / "artifacts" / "engines" / "mol2-small", 1, 1, a.port,
                       nixl_threshold_bytes=a.nixl_threshold_bytes)
        d.start()
        try:
            conv = Conversation(d.url, "measure")
            wall = []
            for i in range(a.turns):
                t0 = time.perf_counter()
                conv.say(TEXTS[i % len(TEXTS)], max_tokens=a.tokens)
                wall.append(time.perf_counter() - t0)
                print(f"turn {i + 1}/{a.turns}: {wall[-1]:.2f} s", flush=True)
            stats, turns = d.stats(), read_turns(d.run_dir)
            rebuilds = _rebuilds(d, conv, a.rebuilds)
        finally:
            d.stop()
    enc, dec = stats["encoder-0"]["figures"], stats["decoder-0"]["figures"]
    generated = sum(len(t["tokens"]) for t in turns)
    context = turns[-1]["prompt_tokens"] + len(turns[-1]["tokens"]) + 1
    full = _decoder_state_bytes(model, context)
    print()
    print("| measured on loopback (1 encoder + 1 decoder worker, ONNX engines) | value |")
    print("|---|---|")
    print(f"| turns / generated tokens / final context | {len(turns)} / {generated} / {context} positions |")
    print("| turn hand-over: rows (new positions) per turn | "
          f"{dec['handover_turn_rows'] / dec['handover_turns']:.1f} |")
    print("| turn hand-over: bytes per turn (raw; base64 on the wire is 4/3 of it) | "
          f"{dec['handover_turn_bytes'] / dec['handover_turns']:.0f} B "
          f"({dec['handover_turn_bytes'] / dec['handover_turn_rows']:.0f} B per position) |")
    print("| turn hand-over: encoder send -> decoder unpacked | "
          f"{1e3 * dec['handover_turn_transfer_s'] / dec['handover_turns']:.2f} ms per turn |")
    print("| per-token step: bytes (one row back, plus the token) | "
          f"{dec['step_bytes'] / dec['step_rows']:.0f} B per token |")
    print("| per-token step: round trip decoder -> encoder -> decoder | "
          f"{1e3 * dec['step_rtt_s'] / dec['step_calls']:.2f} ms per call |")
    print("| per-token step: of which the encoder engine | "
          f"{1e3 * enc['step_compute_s'] / enc['step_calls']:.2f} ms per call |")
    print("| per-token step: transport + (de)serialisation | "
          f"{1e3 * (dec['step_rtt_s'] - dec['step_encoder_compute_s']) / dec['step_calls']:.2f} ms per call |")
    print(f"| a full decoder-state transfer at {context} positions (global-KV mirror + W rows + rings) | {full} B |")
    print(f"| client wall time per turn ({a.tokens} tokens) | {1e3 * sum(wall) / len(wall):.0f} ms |")
    size, transport, times = rebuilds
    print(f"\n| rebuild hand-over (threshold {a.nixl_threshold_bytes} B) | bytes | transport | encoder send -> decoder "
          f"has the rows (median of {len(times)}; first) |\n|---|---|---|---|")
    print(f"| whole conversation from position 0 | {size} B | {transport} | {1e3 * statistics.median(times):.2f} ms; "
          f"{1e3 * times[0]:.2f} ms |")
    return 0


def _rebuilds(d: Deployment, conv: Conversation, n: int) -> tuple[int, str, list[float]]:
    """Resend the conversation so far under fresh session ids: each is a rebuild whose hand-over carries every
    position. -> its bytes, its transport, the decoder's send->received time of each."""
    times, size, transport = [], 0, ""
    for i in range(n):
        before = d.stats()["decoder-0"]["figures"].get("handover_turn_transfer_s", 0.0)
        Conversation(d.url, f"rebuild-{i}", messages=list(conv.messages[:-2])).say(conv.messages[-2]["content"],
                                                                                    max_tokens=1)
        times.append(d.stats()["decoder-0"]["figures"]["handover_turn_transfer_s"] - before)
        last = read_turns(d.run_dir)[-1]
        assert last["rebuilt"] and last["session"] == f"rebuild-{i}", last
        size, transport = last["handover_bytes"], last["transport"]
    return size, transport, times


def _decoder_state_bytes(model: Path, context: int) -> int:
    """The bytes of a decoder session row after `context` positions: what moving a session without the hand-over
    design (a full state transfer) would cost."""
    from tritonserver_backend.engines import open_engine

    engine = open_engine("torch", model)
    fixed = DecoderRow.empty(engine.layout).nbytes()  # the last W rows and the rings
    return int(fixed + context * 4 * (engine.cfg.head_dim + engine.cfg.index_head_dim))  # + the fp32 global-KV mirror


if __name__ == "__main__":
    raise SystemExit(main())
