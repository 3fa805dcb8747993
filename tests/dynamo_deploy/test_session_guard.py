"""What a client and the workers carry to prove who they are on the Dynamo path (fast; no Dynamo):
dynamo_deploy/session_guard.py."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

import pytest

from dynamo_deploy.session_guard import (
    ENGINE_DATA_KEY,
    CallAuth,
    anonymous_key,
    client_nvext,
    issued_token,
    load_internal_key,
    presented_token,
    wants_engine_data,
)
from dynamo_deploy.worker_common import ENCODER_CONTROL, ENCODER_STEP, WorkerSettings
from tritonserver_backend.auth.admin_auth import AdminKeyError
from tritonserver_backend.auth.session_auth import REFUSAL, InternalKey, SessionRefused, new_token


def test_the_client_side_round_trip() -> None:
    """What `Conversation` sends is what the worker reads (as the frontend hands it on: nvext.annotations -> the
    request's `annotations`, nvext.extra_fields -> extra_args.nvext), and the worker's engine_data is what it reads."""
    first = client_nvext(None)
    assert first == {"extra_fields": ["engine_data"]}
    request = {"annotations": first.get("annotations", []),
               "extra_args": {"nvext": {"extra_fields": first["extra_fields"]}}}
    assert presented_token(request) is None and wants_engine_data(request)
    token = new_token()
    later = client_nvext(token)
    request = {"annotations": ["something-else", *later["annotations"]],
               "extra_args": {"nvext": {"extra_fields": later["extra_fields"]}}}
    assert presented_token(request) == token
    assert (not wants_engine_data({})
            and not wants_engine_data({"extra_args": {"nvext": {"extra_fields": "engine_data"}}}))
    assert issued_token({"engine_data": {ENGINE_DATA_KEY: token}}) == token
    assert issued_token(None) is None and issued_token({"engine_data": "x"}) is None


def _key() -> InternalKey:
    return InternalKey(new_token() * 2)


def test_signed_calls_are_taken_once_and_only_as_signed() -> None:
    key = _key()
    signer, checker = CallAuth(key), CallAuth(key)
    body = {"sessions": ["s#1.0"], "tokens": [[5, 6]], "turn_done": False}
    signed = signer.sign(ENCODER_STEP, body)
    assert "auth" in signed and key.value not in str(signed)  # an HMAC travels, never the key
    checker.check(ENCODER_STEP, signed, body["sessions"])
    refused = []
    for name, call, endpoint in [
        ("replayed", signed, ENCODER_STEP),
        ("another endpoint", signer.sign(ENCODER_STEP, body), ENCODER_CONTROL),
        ("tampered", {**signer.sign(ENCODER_STEP, body), "tokens": [[7, 6]]}, ENCODER_STEP),
        ("unsigned", body, ENCODER_STEP),
        ("garbage", {**body, "auth": "12:zz"}, ENCODER_STEP),
        ("another key", CallAuth(_key()).sign(ENCODER_STEP, body), ENCODER_STEP),
    ]:
        with pytest.raises(SessionRefused) as caught:
            checker.check(endpoint, call, body["sessions"])
        refused.append(str(caught.value))
    assert set(refused) == {REFUSAL.format(session_id="s#1.0")}  # one message for every refusal
    same_again = signer.sign(ENCODER_STEP, body)  # the same body signed again later is a new call
    checker.check(ENCODER_STEP, same_again, body["sessions"])


def test_a_signed_call_expires() -> None:
    key = _key()
    signed = CallAuth(key).sign(ENCODER_CONTROL, {"op": "end", "session_id": "s"})
    time.sleep(0.01)
    with pytest.raises(SessionRefused):
        CallAuth(key, ttl_s=0.001).check(ENCODER_CONTROL, signed, ["s"])


def test_anonymous_conversations_are_keyed_by_their_whole_history() -> None:
    assert anonymous_key([1, 2, 3]) == anonymous_key([1, 2, 3])
    assert anonymous_key([1, 2, 3]) != anonymous_key([1, 2, 4]) != anonymous_key([1, 2])
    assert len(anonymous_key([1])) == len("anon-") + 64  # the full digest: not a guessable short id


def test_worker_flags(tmp_path: Path) -> None:
    base = ["--index", "0", "--run-dir", str(tmp_path), "--model-dir", "m", "--engine-dir", "e", "--registry-root", "r"]
    settings = WorkerSettings.from_args("encoder", base)
    assert settings.session_auth and settings.internal_key_path == tmp_path / "internal.key"
    settings = WorkerSettings.from_args("decoder",
                                        [*base, "--no-session-auth", "--internal-key-file", str(tmp_path / "k")])
    assert not settings.session_auth and settings.internal_key_path == tmp_path / "k"
    key = InternalKey.from_file(settings.internal_key_path)  # what each worker does at start-up: created once, 0600
    assert stat.S_IMODE(settings.internal_key_path.stat().st_mode) == 0o600
    assert InternalKey.from_file(settings.internal_key_path).value == key.value


def test_a_worker_that_loses_the_race_for_the_key_file_waits_for_its_content(tmp_path: Path) -> None:
    """Workers starting together on a shared run folder: one creates the file (exclusively), another may open it before
    the key is written, and waits for it rather than failing."""
    path = tmp_path / "internal.key"
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # created, not yet written
    secret = new_token() * 2
    writer = threading.Timer(0.3, lambda: path.write_text(secret + "\n"))
    writer.start()
    try:
        assert load_internal_key(path, wait_s=10).value == secret
    finally:
        writer.join()
    for short in ("short", "x" * 20):  # too short for the admin-key checks, then for an internal key: fails in the end
        path.write_text(short + "\n")
        with pytest.raises((AdminKeyError, ValueError)):
            load_internal_key(path, wait_s=0.2)
