"""A worker killed while it streams a turn (issue 51): the client's stream ends with a clear error (HTTP 503,
service_unavailable), the same conversation resent is served again from a state rebuilt from its history on a live
worker, with the tokens of an undisturbed session, and a session on the surviving workers never notices. Each test
prints the time from the kill to the resent turn's reply (docs/scale_out.md records them).

Both run on the package's fleet (conftest.py), after test_deployment's encoder kill: two encoders and two decoders
live; the decoder case leaves one decoder, the encoder case one encoder."""

from __future__ import annotations

import time

import pytest

from dynamo_deploy.client import Conversation, stream_chat
from dynamo_deploy.launcher import Deployment
from tests.dynamo_deploy.test_deployment import CONVERSATION, MAX_TOKENS, _reference_turns, _served, live_workers

pytestmark = pytest.mark.slow
LONG = 400  # the cut turn's budget (ignore_eos): it is still streaming when the worker dies


def _stream_and_kill(conv: Conversation, text: str, after_chunks: int, kill) -> tuple[int, list[dict], str | None]:  # type: ignore[no-untyped-def]
    """Stream a long turn of `conv`, call `kill()` after `after_chunks` content chunks and read the stream to its end:
    -> (content chunks, the error events, the finish reason if the turn finished)."""
    body = {"model": conv.model, "messages": [*conv.messages, {"role": "user", "content": text}], "max_tokens": LONG,
            "temperature": 0.0, "ignore_eos": True, "nvext": conv._nvext()}
    chunks, errors, finish = 0, [], None
    for event in stream_chat(conv.url, body, conv._headers(), timeout_s=120):
        if "error" in event:
            errors.append(event["error"])
            continue
        for choice in event.get("choices", []):
            chunks += bool((choice.get("delta") or {}).get("content"))
            finish = choice.get("finish_reason") or finish
        if chunks == after_chunks:
            kill()
    return chunks, errors, finish


def _retry_until_served(conv: Conversation, text: str, within_s: float) -> float:
    t0 = time.monotonic()
    while True:
        try:
            conv.say(text, max_tokens=MAX_TOKENS)
            return time.monotonic() - t0
        except RuntimeError as exc:  # an HTTP error: nothing was kept for the client, the message was taken back
            if time.monotonic() - t0 > within_s:
                raise AssertionError(f"not served again within {within_s:.0f} s: {exc}") from None
            time.sleep(0.5)


@pytest.fixture(scope="module")
def fleet(dynamo_fleet: Deployment) -> Deployment:
    return dynamo_fleet  # tests/dynamo_deploy/conftest.py: after test_deployment's tests, one worker fewer per kill


@pytest.mark.parametrize("role", ["decoder", "encoder"])
def test_a_worker_killed_mid_stream_costs_one_turn_and_no_session(role, fleet, reference) -> None:  # type: ignore[no-untyped-def]
    assert len(live_workers(fleet, role)) >= 2, fleet.procs  # the victim's and a bystander's
    victim_conv = Conversation(fleet.url, f"victim-{role}")
    victim_conv.say(CONVERSATION[0], max_tokens=MAX_TOKENS)
    where = "decoder" if role == "decoder" else "instance_id"
    held = _served(fleet.run_dir, f"victim-{role}")[0][where]
    victim = next(n for n, w in fleet.stats().items() if w["instance_id"] == held)
    for i in range(8):  # a bystander on the other worker (decoders: round robin; encoders: the frontend's router)
        bystander = Conversation(fleet.url, f"bystander-{role}-{i}")
        bystander.say(CONVERSATION[3], max_tokens=MAX_TOKENS)
        if _served(fleet.run_dir, bystander.session_id)[0][where] != held:
            break
    else:
        raise AssertionError(f"no session of 8 landed on another {role} than {victim}")

    killed_at: list[float] = []
    chunks, errors, finish = _stream_and_kill(victim_conv, CONVERSATION[1], 5,
                                              lambda: (fleet.kill(victim), killed_at.append(time.monotonic())))
    assert killed_at and 5 <= chunks < LONG and finish is None  # cut, never finished as if whole
    assert [e.get("code") for e in errors] == [503] and errors[0]["type"] == "service_unavailable"

    waited = _retry_until_served(victim_conv, CONVERSATION[1], within_s=90)
    recovered = time.monotonic() - killed_at[0]
    print(f"{role} killed mid-stream after {chunks} chunks: resent turn served {recovered:.1f} s after the kill "
          f"({waited:.1f} s of retries)")
    victim_conv.say(CONVERSATION[2], max_tokens=MAX_TOKENS)
    served = _served(fleet.run_dir, f"victim-{role}")
    assert served[1]["rebuilt"] and served[1][where] != held and not served[2]["rebuilt"]
    expected = _reference_turns(reference, f"ref-kill-{role}", CONVERSATION[:3])
    assert [t["tokens"] for t in served] == expected  # as if the cut turn never happened

    bystander.say(CONVERSATION[4], max_tokens=MAX_TOKENS)  # the other worker's session never noticed
    calm = _served(fleet.run_dir, bystander.session_id)
    assert not any(t["rebuilt"] for t in calm)
    assert ([t["tokens"] for t in calm]
            == _reference_turns(reference, f"ref-calm-{role}", [CONVERSATION[3], CONVERSATION[4]]))
