"""Session tokens and the internal key (session_auth.py), and the encoder service that enforces them, in process:
who may continue, restart, end or cancel a session, what a refused client is told, and that a refusal changes
nothing."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest

from tests.conftest import EMBEDDED
from tritonserver_backend.auth.session_auth import (
    REFUSAL,
    GrantLedger,
    InternalKey,
    SessionRefused,
    SessionTokens,
    internal_key_path,
    parse_switch,
    token_digest,
)
from tritonserver_backend.core import counters as k
from tritonserver_backend.errors import UnknownSession
from tritonserver_backend.sampling.sampler import SamplingParams

PARAMS = SamplingParams(max_tokens=4)


def refusal_text(session_id: str) -> str:
    return re.escape(REFUSAL.format(session_id=session_id))


# ------------------------------------------------------------------------------------- tokens and keys
def test_issued_tokens_are_long_random_and_kept_only_as_digests() -> None:
    tokens = SessionTokens()
    issued = {tokens.issue(f"s{i}") for i in range(200)}
    assert len(issued) == 200, "no token repeats"
    for token in issued:
        assert len(token) >= 22 and re.fullmatch(r"[A-Za-z0-9_-]+", token), token  # >= 128 bits of base64url
    held = repr(vars(tokens))
    assert not any(t in held for t in issued), "the store holds digests, never a token"
    assert token_digest(next(iter(issued))) in held


def test_a_live_session_opens_with_its_own_token_only_and_every_refusal_reads_the_same() -> None:
    tokens = SessionTokens()
    alice = tokens.issue("alice-1")
    tokens.issue("bob-1")
    tokens.check("alice-1", alice)
    messages = []
    for session, token in [("alice-1", None), ("alice-1", ""), ("alice-1", alice[:-1]),
                           ("alice-1", tokens.issue("bob-2")), ("nobody", None), ("nobody", alice)]:
        with pytest.raises(SessionRefused) as refused:
            tokens.check(session, token)
        messages.append(str(refused.value).replace(repr(session), "ID"))
    assert len(set(messages)) == 1, messages  # an existing, unknown or foreign session cannot be told apart


def test_a_gone_session_tells_its_owner_why_and_nobody_else() -> None:
    tokens = SessionTokens()
    alice = tokens.issue("alice-1")
    tokens.forget("alice-1")
    reason = UnknownSession("session 'alice-1' was ended")
    with pytest.raises(UnknownSession, match="was ended"):
        tokens.check_gone("alice-1", alice, reason)
    with pytest.raises(SessionRefused, match=refusal_text("alice-1")):
        tokens.check_gone("alice-1", "a guess", reason)
    with pytest.raises(SessionRefused):
        tokens.check("alice-1", alice)  # a gone session's token opens nothing


def test_tokens_off_issue_nothing_and_check_nothing() -> None:
    tokens = SessionTokens(enabled=False)
    assert tokens.issue("s") == ""
    tokens.check("s", None)
    tokens.check("never", "x")
    assert parse_switch("off") is False and parse_switch("true") is True and parse_switch("") is True
    with pytest.raises(ValueError, match="session_auth must be true or false"):
        parse_switch("maybe")


def test_grants_bind_session_position_and_freshness_and_are_taken_once_in_order(tmp_path) -> None:  # type: ignore[no-untyped-def]
    key = InternalKey.from_file(internal_key_path(tmp_path))
    assert (internal_key_path(tmp_path).stat().st_mode & 0o777) == 0o600
    assert InternalKey.from_file(internal_key_path(tmp_path)).value == key.value, "every model reads the one key"
    other = InternalKey("x" * 40)
    first = key.grant("alice-1", 0)
    assert key.verify(first, "alice-1", 0) > 0
    for grant, session, position in [(first, "bob-1", 0), (first, "alice-1", 1),
                                     (other.grant("alice-1", 0), "alice-1", 0),
                                     ("", "alice-1", 0), ("123:abc", "alice-1", 0), ("garbage", "alice-1", 0)]:
        with pytest.raises(SessionRefused):
            key.verify(grant, session, position)
    stale = f"{time.time_ns() - 10**12}:" + first.partition(":")[2]
    with pytest.raises(SessionRefused):
        key.verify(stale, "alice-1", 0)
    ledger = GrantLedger()
    second = key.grant("alice-1", 7)
    ledger.take("alice-1", key.verify(second, "alice-1", 7))
    with pytest.raises(SessionRefused):
        ledger.take("alice-1", key.verify(second, "alice-1", 7))  # a grant is taken once
    with pytest.raises(SessionRefused):
        ledger.take("alice-1", key.verify(first, "alice-1", 0))  # and never one older than the session's last
    assert key.matches(key.value) and not key.matches(None) and not key.matches(key.value[:-1])


# ------------------------------------------------------------------------------------- the encoder service
@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):  # type: ignore[no-untyped-def]
    from tritonserver_backend.adapters.registry_init import ensure_registry
    from tritonserver_backend.core.pipeline import InProcessPipeline

    root = tmp_path_factory.mktemp("registry")
    ensure_registry(root, EMBEDDED)
    return InProcessPipeline(EMBEDDED, root, session_auth=True)


def _state(pipeline, session: str) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    return pipeline.encoder.sessions.get(session).position, pipeline.decoder.sessions.get(session).position


def test_strangers_cannot_continue_restart_rebuild_or_end_a_live_session(pipeline) -> None:  # type: ignore[no-untyped-def]
    first = pipeline.chat("alice-1", "My bank PIN is 4921.", new_session=True, params=PARAMS)
    token = first.session_token
    assert token, "the turn that starts a session carries its token"
    before = _state(pipeline, "alice-1")
    refusals = pipeline.encoder.counters.get(k.TOKEN_REFUSALS, k.PATH_TURN)
    history = json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    attempts = [dict(), dict(session_token="wrong"), dict(new_session=True), dict(new_session=True, session_token=""),
                dict(history=history), dict(end_session=True)]
    for attempt in attempts:
        with pytest.raises(SessionRefused, match=refusal_text("alice-1")):
            pipeline.chat("alice-1", "What was my PIN?", params=PARAMS, **attempt)
        assert _state(pipeline, "alice-1") == before, f"{attempt} changed the session"
    assert pipeline.encoder.counters.get(k.TOKEN_REFUSALS, k.PATH_TURN) == refusals + len(attempts)
    second = pipeline.chat("alice-1", "What was my PIN?", params=PARAMS, session_token=token)
    assert second.token_ids and second.session_token == "", "a continuing turn keeps the session's token"
    with pytest.raises(SessionRefused):
        pipeline.encoder.check_token("alice-1", "wrong", k.PATH_CANCEL)
    assert pipeline.encoder.counters.get(k.TOKEN_REFUSALS, k.PATH_CANCEL) == 1
    pipeline.encoder.check_token("alice-1", token, k.PATH_CANCEL)


def test_the_owner_restarts_and_ends_with_its_token_and_rebuilds_get_fresh_tokens(pipeline) -> None:  # type: ignore[no-untyped-def]
    token = pipeline.chat("bob-1", "Hello.", new_session=True, params=PARAMS).session_token
    restarted = pipeline.chat("bob-1", "Hello again.", new_session=True, params=PARAMS, session_token=token)
    assert restarted.session_token and restarted.session_token != token, "a restart issues a new token"
    with pytest.raises(SessionRefused):
        pipeline.chat("bob-1", "Still there?", params=PARAMS, session_token=token)  # the old token is void
    pipeline.chat("bob-1", "Bye.", params=PARAMS, session_token=restarted.session_token, end_session=True)
    with pytest.raises(UnknownSession, match="was ended"):  # its owner learns why
        pipeline.chat("bob-1", "Hello?", params=PARAMS, session_token=restarted.session_token)
    with pytest.raises(SessionRefused, match=refusal_text("bob-1")):  # anyone else learns nothing
        pipeline.chat("bob-1", "Hello?", params=PARAMS)
    history = json.dumps([{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."}])
    rebuilt = pipeline.chat("bob-1", "Hello?", history=history, params=PARAMS)  # the recovery path stays open
    assert rebuilt.session_token not in ("", token, restarted.session_token)
    fresh = pipeline.chat("carol-1", "Hi.", new_session=True, params=PARAMS)
    assert fresh.session_token not in ("", rebuilt.session_token)


def test_a_rolled_back_restart_keeps_the_session_s_token(pipeline) -> None:  # type: ignore[no-untyped-def]
    """A turn the decoder rejects is undone in full: the restart's new token goes, the old one opens the session."""
    token = pipeline.chat("dave-1", "Hello.", new_session=True, params=PARAMS).session_token
    ids, prefix, _ = pipeline.text.preprocess("Again.", True, None)
    restarted = pipeline.encoder.encode_turn("dave-1", ids, prefix, True, token)
    assert restarted.issued_token
    pipeline.encoder.rollback("dave-1")
    pipeline.encoder.check_token("dave-1", token, k.PATH_TURN)
    with pytest.raises(SessionRefused):
        pipeline.encoder.check_token("dave-1", restarted.issued_token, k.PATH_TURN)


def test_session_auth_off_lets_any_caller_continue(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tritonserver_backend.core.encoder_service import EncoderService
    from tritonserver_backend.engines import open_engine

    service = EncoderService(open_engine("torch", EMBEDDED), session_auth=False)
    ids = np.array([5, 6, 7], np.int64)
    assert service.encode_turn("open", ids, start=True).issued_token == ""
    service.encode_step(["open"], ids[-1:].reshape(1, 1), turn_done=True)
    assert service.encode_turn("open", ids).handover["positions"][0] == 4
