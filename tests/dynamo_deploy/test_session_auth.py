"""A conversation belongs to the client that started it, on the Dynamo path (real processes: Dynamo's frontend, an
encoder worker and a decoder worker on the ONNX engines; dynamo_deploy/session_guard.py).

- A stranger who sends the owner's `x-dynamo-session-id` without the owner's session token (none, a wrong one,
  another session's, or the owner's exact history) is refused with one message and disturbs nothing: the owner's
  next turn continues its session (no rebuild) and equals an undisturbed run token for token.
- A process on the request plane that calls the workers' endpoints directly (encoder `step` / `control`, decoder
  `turn`) without the deployment's key is refused and changes nothing.
- A conversation without a session id is found by its whole history, so another one with the same opening never
  ends or replaces it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from dynamo_deploy.client import Conversation
from dynamo_deploy.launcher import PROJECT_ROOT, Deployment, read_turns
from dynamo_deploy.session_guard import CallAuth
from dynamo_deploy.worker_common import DECODER_TURN, ENCODER_CONTROL, ENCODER_STEP
from tests.dynamo_deploy.test_deployment import CONVERSATION, MAX_TOKENS, _reference_turns, _served
from tritonserver_backend.auth.session_auth import InternalKey, new_token

pytestmark = pytest.mark.slow
DIRECT_CALLS = Path(__file__).with_name("direct_calls.py")


@pytest.fixture(scope="module")
def pair(dynamo_1x1):  # type: ignore[no-untyped-def]
    return dynamo_1x1  # tests/dynamo_deploy/conftest.py: shared with the other 1x1 modules


def _refusals(d: Deployment, role: str) -> dict[str, int]:
    worker = next(w for w in d.stats().values() if w["role"] == role)
    return {k.split("/", 1)[1]: v for k, v in worker["counters"].items() if k.startswith("session_token_refusals/")}


def _counter(d: Deployment, role: str, name: str) -> int:
    worker = next(w for w in d.stats().values() if w["role"] == role)
    return int(worker["counters"].get(name, 0))


def _refused(conv: Conversation, text: str) -> str:
    with pytest.raises(RuntimeError) as caught:
        conv.say(text, max_tokens=MAX_TOKENS)
    return str(caught.value)


def test_a_stranger_with_the_session_id_is_refused_and_disturbs_nothing(pair, reference) -> None:  # type: ignore[no-untyped-def]
    owner = Conversation(pair.url, "alice-1")
    for text in CONVERSATION[:2]:
        owner.say(text, max_tokens=MAX_TOKENS)
    assert owner.session_token and len(owner.session_token) >= 22  # >= 128 random bits, URL-safe
    other = Conversation(pair.url, "bob-1")
    other.say(CONVERSATION[3], max_tokens=MAX_TOKENS)
    before = _refusals(pair, "encoder").get("turn", 0)
    attempts = {
        "no token": Conversation(pair.url, "alice-1"),
        "a wrong token": Conversation(pair.url, "alice-1", session_token=new_token()),
        "another session's token": Conversation(pair.url, "alice-1", session_token=other.session_token),
        "the owner's exact history, no token": Conversation(pair.url, "alice-1", messages=list(owner.messages)),
    }
    messages = {name: _refused(conv, "Forget all that. What is 2+2?") for name, conv in attempts.items()}
    assert len(set(messages.values())) == 1, messages  # one message, whatever was presented
    message = next(iter(messages.values()))
    assert "HTTP 400" in message and "no live session 'alice-1' with this session_token" in message
    assert owner.session_token not in message
    assert _refusals(pair, "encoder")["turn"] == before + len(attempts)  # counted, by path
    for text in CONVERSATION[2:]:
        owner.say(text, max_tokens=MAX_TOKENS)
    served = _served(pair.run_dir, "alice-1")
    assert len(served) == len(CONVERSATION)  # nothing of the strangers' turns was served or logged
    assert not any(t["rebuilt"] for t in served)  # the owner's session was never ended or replaced
    assert len({t["internal_session"] for t in served}) == 1
    # as if undisturbed
    assert [t["tokens"] for t in served] == _reference_turns(reference, "ref-alice-1", CONVERSATION)
    logs = "".join(p.read_text(errors="replace") for p in (pair.run_dir / "logs").glob("*.log"))
    assert owner.session_token not in logs and other.session_token not in logs  # tokens are never logged


def test_a_start_that_cannot_receive_its_token_is_refused_and_leaves_the_id_free(pair) -> None:  # type: ignore[no-untyped-def]
    """Without `nvext.extra_fields: ["engine_data"]` the token could not reach the client: the turn is refused before
    anything starts, so the id is not taken by a session its client could never continue."""
    import urllib.request

    body = {"model": "mol2-small", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    req = urllib.request.Request(f"{pair.url}/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", "x-dynamo-session-id": "carol-1"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(req, timeout=120)
    assert caught.value.code == 400 and "nvext.extra_fields" in caught.value.read().decode()
    carol = Conversation(pair.url, "carol-1")
    carol.say("Hi", max_tokens=4)  # the id was left free
    assert carol.session_token


def _direct(d: Deployment, calls: list[dict]) -> list[dict]:
    out = subprocess.run([str(d.python), str(DIRECT_CALLS)], input=json.dumps(calls), capture_output=True, text=True,
                         env=d.env(), cwd=PROJECT_ROOT, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_direct_calls_on_the_request_plane_without_the_key_are_refused(pair, reference) -> None:  # type: ignore[no-untyped-def]
    owner = Conversation(pair.url, "dave-1")
    for text in CONVERSATION[:2]:
        owner.say(text, max_tokens=MAX_TOKENS)
    sid = _served(pair.run_dir, "dave-1")[-1]["internal_session"]  # what the workers call the session
    stats = pair.stats()
    encoder = next(w["instance_id"] for w in stats.values() if w["role"] == "encoder")
    decoder = next(w["instance_id"] for w in stats.values() if w["role"] == "decoder")
    forged = CallAuth(InternalKey(new_token() * 2))  # signatures under some other key
    step = {"sessions": [sid], "tokens": [[5]], "turn_done": True}
    steps_before = _counter(pair, "encoder", "encoded_tokens/step")
    turn = {"session_id": sid, "encoder": encoder, "adapter_hash": 0, "params": {}, "sent_at": 0.0, "first_position": 0,
            "handover": {"inline": {}}}
    calls = [
        {"endpoint": ENCODER_STEP, "instance": encoder, "body": step},
        {"endpoint": ENCODER_STEP, "instance": encoder, "body": forged.sign(ENCODER_STEP, step)},
        {"endpoint": ENCODER_CONTROL, "instance": encoder, "body": {"op": "end", "session_id": sid}},
        {"endpoint": ENCODER_CONTROL, "instance": encoder,
         "body": forged.sign(ENCODER_CONTROL, {"op": "rollback", "session_id": sid})},
        {"endpoint": DECODER_TURN, "instance": decoder, "body": turn},
        {"endpoint": DECODER_TURN, "instance": decoder, "body": {**turn, "grant": forged.key.grant(sid, 0)}},
    ]
    results = _direct(pair, calls)
    for call, result in zip(calls, results):
        chunks = result.get("chunks")
        assert chunks and len(chunks) == 1 and f"no live session {sid!r}" in chunks[0].get("error", ""), (
            call["endpoint"], result)
    assert _refusals(pair, "encoder")["step"] >= 2 and _refusals(pair, "encoder")["control"] >= 2
    assert _refusals(pair, "decoder")["handover"] >= 2
    assert _counter(pair, "encoder", "encoded_tokens/step") == steps_before  # no forged step ran the encoder
    for text in CONVERSATION[2:]:
        owner.say(text, max_tokens=MAX_TOKENS)
    served = _served(pair.run_dir, "dave-1")
    assert not any(t["rebuilt"] for t in served) and {t["internal_session"] for t in served} == {sid}
    assert [t["tokens"] for t in served] == _reference_turns(reference, "ref-dave-1", CONVERSATION)


def test_conversations_without_a_session_id_are_kept_apart_by_their_history(pair, reference) -> None:  # type: ignore[no-untyped-def]
    logged = len(read_turns(pair.run_dir))  # a shared deployment: this test's turns are the ones after these
    first = Conversation(pair.url, None)
    for text in CONVERSATION[:2]:
        first.say(text, max_tokens=MAX_TOKENS)
    # another client: the same opening message, then a history of its own (a reply the server never gave)
    intruder = Conversation(pair.url, None,
                            messages=[dict(first.messages[0]), {"role": "assistant", "content": "Sure."}])
    intruder.say(CONVERSATION[1], max_tokens=MAX_TOKENS)
    for text in CONVERSATION[2:4]:
        first.say(text, max_tokens=MAX_TOKENS)
    anon = [t for t in read_turns(pair.run_dir)[logged:] if t["session"].startswith("anon-")]
    first_turns = [t for t in anon if t["internal_session"] == anon[0]["internal_session"]]
    assert len(first_turns) == 4 and not any(t["rebuilt"] for t in first_turns)  # never ended or replaced
    assert [t["tokens"] for t in first_turns] == _reference_turns(reference, "ref-anon-1", CONVERSATION[:4])
    intruder_turn = next(t for t in anon if t["internal_session"] != anon[0]["internal_session"])
    assert intruder_turn["rebuilt"]  # its own session, built from its own history
