"""The loopback Dynamo deployment (real processes: Dynamo's frontend, encoder and decoder workers on the ONNX engines)
against the single-server path (`InProcessPipeline`, which the Triton tests hold equal to the served ensemble).

The routing tests and the encoder kill run on the package's fleet (conftest.py: 3 encoders, 2 decoders; the kill
comes last, after every routing test); the decoder kill, whose hand-overs cross NIXL, starts a deployment of its own
(a worker's NIXL agent busy-polls a core from start-up, transfer.py: no option for a fleet that serves many tests).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from dynamo_deploy.client import Conversation
from dynamo_deploy.launcher import Deployment, read_turns
from dynamo_deploy.model_ids import model_id
from tests.dynamo_deploy.conftest import deploy
from tritonserver_backend.adapters.registry import Registry
from tritonserver_backend.core import counters as k
from tritonserver_backend.core.pipeline import InProcessPipeline
from tritonserver_backend.sampling.sampler import SamplingParams

pytestmark = pytest.mark.slow
MAX_TOKENS = 16
CONVERSATION = ["Hi! How was your day?", "def mean(xs):\n    return sum(xs) / len(xs)",
                "Make the header sticky with a shadow.", "git log --oneline shows nothing, why?", "Thanks, that helps."]
OPENERS = ["Hello there, any plans today?", "import numpy as np\nx = np.zeros(3)",
           "The button colour looks off on mobile.", "How do I squash my last two commits?"]


@pytest.fixture(scope="module")
def fleet(dynamo_fleet: Deployment) -> Deployment:
    return dynamo_fleet  # tests/dynamo_deploy/conftest.py: shared with test_faults, whose kills come after these


def _reference_turns(pipe: InProcessPipeline, session: str, texts: list[str]) -> list[list[int]]:
    return [pipe.chat(session, t, new_session=(i == 0), params=SamplingParams(max_tokens=MAX_TOKENS)).token_ids
            for i, t in enumerate(texts)]


def _served(run_dir: Path, session: str) -> list[dict]:
    return [t for t in read_turns(run_dir) if t["session"] == session]


def test_routed_conversation_equals_single_server(fleet, reference) -> None:  # type: ignore[no-untyped-def]
    conv = Conversation(fleet.url, "equal-0")
    replies = [conv.say(text, max_tokens=MAX_TOKENS) for text in CONVERSATION]
    expected = _reference_turns(reference, "ref-equal-0", CONVERSATION)
    served = _served(fleet.run_dir, "equal-0")
    assert [t["tokens"] for t in served] == expected  # token for token, every turn
    for reply, ids in zip(replies, expected):
        assert reply["text"] == reference.text.decode(ids)  # and the text the client got
        assert reply["usage"]["completion_tokens"] == len(ids)
    assert not any(t["rebuilt"] for t in served)
    assert ([t["new_tokens"] for t in served[1:]]
            == [len(reference.text.tokenizer.turn({"role": "user", "content": c}, True))
                for c in CONVERSATION[1:]])  # later turns encode only the new turn
    assert len({t["adapter_hash"] for t in served}) > 1  # the router chose more than one adapter along the way


def test_concurrent_sessions_stay_on_their_workers(fleet, reference) -> None:  # type: ignore[no-untyped-def]
    texts = {f"conc-{i}": [opener, *CONVERSATION[1:3]] for i, opener in enumerate(OPENERS)}
    errors: list[BaseException] = []

    def talk(session: str) -> None:
        try:
            conv = Conversation(fleet.url, session)
            for text in texts[session]:
                conv.say(text, max_tokens=MAX_TOKENS)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=talk, args=(s,)) for s in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    placements = {}
    for session, session_texts in texts.items():
        served = _served(fleet.run_dir, session)
        assert len(served) == len(session_texts)
        assert len({(t["worker"], t["decoder"]) for t in served}) == 1, served  # every turn on the same pair of workers
        assert not any(t["rebuilt"] for t in served)
        assert [t["tokens"] for t in served] == _reference_turns(reference, f"ref-{session}", session_texts)
        placements[session] = (served[0]["worker"], served[0]["decoder"])
    print("placements:", placements)
    decoders = {d for _, d in placements.values()}
    assert len(decoders) == 2, placements  # both decoder workers took sessions (the fleet has two)
    stats = fleet.stats()
    written = sum(v for w in stats.values() if w["role"] == "encoder" for k, v in w["counters"].items()
                  if k.startswith("routing_decisions_written"))
    applied = sum(v for w in stats.values() if w["role"] == "decoder" for k, v in w["counters"].items()
                  if k.startswith("routing_decisions_applied"))
    assert written == applied == len(read_turns(fleet.run_dir))


def test_explicit_adapter_wins_over_routing(fleet, reference) -> None:  # type: ignore[no-untyped-def]
    """Model ids `mol2-small:<adapter>` / `mol2-small:base` (Dynamo LoRA cards) through the OpenAI frontend: the named
    adapter answers even where the router would pick another, and routing resumes with `mol2-small`."""
    assert {"mol2-small", "mol2-small:base", "mol2-small:L2_code", "mol2-small:L0_chat"} <= set(fleet._models())
    texts = CONVERSATION[:4]
    plan = [None, "base", "L2_code", None]  # explicit adapter per turn (None: routed)
    would_route = [reference.chat("ref-explicit-probe", t, new_session=(i == 0),
                                  params=SamplingParams(max_tokens=MAX_TOKENS)).adapter
                   for i, t in enumerate(texts)]
    assert would_route[2] != "L2_code" and would_route[1] != "base"  # the explicit choice is not what routing gives
    conv = Conversation(fleet.url, "explicit-0")
    for text, adapter in zip(texts, plan):
        conv.model = model_id(adapter)
        conv.say(text, max_tokens=MAX_TOKENS)
    served = _served(fleet.run_dir, "explicit-0")
    expected = [reference.chat("ref-explicit-0", t, adapter=a, new_session=(i == 0),
                               params=SamplingParams(max_tokens=MAX_TOKENS))
                for i, (t, a) in enumerate(zip(texts, plan))]
    registry = Registry(fleet.run_dir / "registry")
    assert [t["explicit"] for t in served] == plan
    assert [registry.name_of(t["adapter_hash"]) for t in served] == [r.adapter for r in expected]
    assert [registry.name_of(t["adapter_hash"]) for t in served][1:3] == ["base", "L2_code"]
    assert [t["tokens"] for t in served] == [r.token_ids for r in expected]
    # the frontend's session affinity is by session id, across model ids: an adapter switch is a bounded replay on the
    # session's own workers, not a rebuild
    assert len({(t["worker"], t["decoder"]) for t in served}) == 1 and not any(t["rebuilt"] for t in served)


def _wait_turns(run_dir: Path, session: str, n: int, within_s: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + within_s
    while len(served := _served(run_dir, session)) < n:
        assert time.monotonic() < deadline, f"{session}: {len(served)} turns logged, expected {n}"
        time.sleep(0.1)
    return served


def test_client_leaving_mid_stream_cancels_the_turn_and_keeps_the_partial_reply(fleet, reference) -> None:  # type: ignore[no-untyped-def]
    """A streamed turn whose client disconnects: Dynamo stops the encoder's request, the encoder stops the decoder's
    (its own context), the decoder ends the turn early as "cancelled" and the session keeps the partial reply (the
    Triton path's rule). A client that resends that partial reply continues the session without a rebuild, with the
    tokens of the single-server path cut at the same length."""
    long_tokens = 200
    reference.chat("ref-cancel-full", CONVERSATION[0], new_session=True, params=SamplingParams(max_tokens=MAX_TOKENS))
    full = reference.chat("ref-cancel-full", CONVERSATION[1], params=SamplingParams(max_tokens=long_tokens)).token_ids
    conv = Conversation(fleet.url, "cancel-0")
    conv.say(CONVERSATION[0], max_tokens=MAX_TOKENS)
    received = conv.leave_mid_stream(CONVERSATION[1], after_chunks=3, max_tokens=long_tokens)
    cancelled = _wait_turns(fleet.run_dir, "cancel-0", 2)[1]
    kept = cancelled["tokens"]
    assert cancelled["finish"] == "cancelled"
    assert cancelled["client_tokens"] <= len(kept) < len(full)  # stopped early: the decoder did not run the turn out
    assert kept == full[:len(kept)]  # the partial reply is the undisturbed reply's prefix
    assert reference.text.decode(kept).startswith(received)  # the client got a prefix of it
    conv.messages.append({"role": "assistant", "content": reference.text.tokenizer.decode(kept, skip_special=True)})
    for text in CONVERSATION[2:4]:
        conv.say(text, max_tokens=MAX_TOKENS)
    served = _served(fleet.run_dir, "cancel-0")
    assert not any(t["rebuilt"] for t in served) and len({(t["worker"], t["decoder"]) for t in served}) == 1
    lengths = [MAX_TOKENS, len(kept), MAX_TOKENS, MAX_TOKENS]
    expected = [reference.chat("ref-cancel-0", t, new_session=(i == 0), params=SamplingParams(max_tokens=n)).token_ids
                for i, (t, n) in enumerate(zip(CONVERSATION[:4], lengths))]
    assert [t["tokens"] for t in served] == expected


NIXL_THRESHOLD = 192 << 10  # above every single turn's hand-over here (<= ~120 KB), below a rebuild of three turns


def test_sessions_sharing_a_prefix_go_to_the_encoder_that_holds_it(fleet, reference) -> None:  # type: ignore[no-untyped-def]
    """New sessions that open with one document, one after another: Dynamo's KV router (approximate mode: it predicts
    each worker's cache from its own routing, no KV events) sends each to the encoder worker that took the first, where
    the encoder's prefix cache serves the document; every reply equals the single-server one."""
    document = "\n".join(f"{i}. grep -rn 'item {i}' /srv/logs and count the lines" for i in range(40))
    texts = [document + f"\nWhat does line {i} search for?" for i in range(4)]
    before = {w["instance_id"]: w["counters"].get(f"{k.PREFIX_HITS}/{k.PREFIX_SHARED}", 0)
              for w in fleet.stats().values() if w["role"] == "encoder"}
    for i, text in enumerate(texts):
        Conversation(fleet.url, f"shared-prefix-{i}").say(text, max_tokens=MAX_TOKENS)
    served = [_served(fleet.run_dir, f"shared-prefix-{i}")[0] for i in range(4)]
    assert len({t["worker"] for t in served}) == 1, served  # one encoder of three took them all (by chance: 1 in 27)
    after = {w["instance_id"]: w["counters"].get(f"{k.PREFIX_HITS}/{k.PREFIX_SHARED}", 0)
             for w in fleet.stats().values() if w["role"] == "encoder"}
    assert sum(after.values()) - sum(before.values()) == 3  # every session after the first hit its cache
    for i, (t, text) in enumerate(zip(served, texts)):
        assert t["tokens"] == _reference_turns(reference, f"ref-shared-prefix-{i}", [text])[0]


def test_killed_decoder_rebuilds_elsewhere_with_same_tokens(tmp_path, default_engines, reference) -> None:  # type: ignore[no-untyped-def]
    """Also the hand-over's transport rule: turns below the threshold inline, the rebuild's long hand-over through NIXL,
    with the tokens of the single-server path either way."""
    d = deploy(tmp_path / "dynamo-1x2", default_engines, encoders=1, decoders=2, nixl_threshold_bytes=NIXL_THRESHOLD)
    try:
        conv = Conversation(d.url, "killed-0")
        for text in CONVERSATION[:2]:
            conv.say(text, max_tokens=MAX_TOKENS)
        before = _served(d.run_dir, "killed-0")
        victim_id = before[-1]["decoder"]
        victim = next(n for n, w in d.stats().items() if w["instance_id"] == victim_id)
        d.kill(victim)
        for text in CONVERSATION[2:]:
            conv.say(text, max_tokens=MAX_TOKENS)
        served = _served(d.run_dir, "killed-0")
        assert served[2]["rebuilt"] and served[2]["decoder"] != victim_id  # rebuilt from the conversation elsewhere
        assert (not any(t["rebuilt"] for t in served[3:])
                and {t["decoder"] for t in served[2:]} == {served[2]["decoder"]})
        # as if undisturbed
        assert [t["tokens"] for t in served] == _reference_turns(reference, "ref-killed-0", CONVERSATION)
        assert [t["transport"] for t in served] == ["nixl" if t["handover_bytes"] >= NIXL_THRESHOLD else "inline"
                                                    for t in served]
        assert served[2]["transport"] == "nixl" and all(t["transport"] == "inline" for t in served[:2] + served[3:])
        stats = d.stats()
        received = {k: sum(w["figures"].get(k, 0) for n, w in stats.items() if w["role"] == "decoder")
                    for k in ("received_nixl_bytes", "received_inline_bytes")}
        sent = {k: stats["encoder-0"]["figures"].get(k, 0) for k in ("sent_nixl_bytes", "sent_inline_bytes")}
        # per-worker counters
        assert received["received_nixl_bytes"] == sent["sent_nixl_bytes"] == served[2]["handover_bytes"]
        inline = sum(t["handover_bytes"] for t in served) - served[2]["handover_bytes"]
        assert received["received_inline_bytes"] == inline  # the decoders got exactly the inline turns
        assert sent["sent_inline_bytes"] > inline  # + the first try of turn 3, offered to the dead decoder
    finally:
        d.stop()


def _say_until_served(conv: Conversation, text: str, within_s: float) -> tuple[int, float]:
    """One turn, retried while the deployment answers with an HTTP error (a dead worker not yet dropped from
    discovery): -> (failed tries, seconds until served). Only an error, never a reply, may precede the served one."""
    t0, failures = time.monotonic(), 0
    while True:
        try:
            conv.say(text, max_tokens=MAX_TOKENS)
            return failures, time.monotonic() - t0
        except RuntimeError as exc:  # HTTP error: the message was taken back, nothing was absorbed for the client
            failures += 1
            if time.monotonic() - t0 > within_s:
                raise AssertionError(f"not served within {within_s:.0f} s after {failures} tries: {exc}") from None
            time.sleep(1.0)


def live_workers(d: Deployment, role: str) -> list[str]:
    """The names of `d`'s worker processes of `role` not killed yet (a shared fleet loses one per kill test)."""
    return [n for n in d.procs if n.startswith(f"{role}-")]


def test_killed_encoder_rebuilds_on_the_other_with_same_tokens(fleet, reference) -> None:  # type: ignore[no-untyped-def]
    """The session's encoder is SIGKILLed between turns (on the fleet, after its routing tests: three encoders, two
    after this test). The frontend keeps the session pinned to it until Dynamo's file discovery drops the dead
    instance (its lease, ~10 s measured); meanwhile the turn fails with an HTTP error. Then the turn goes to another
    encoder, which rebuilds the session from the resent conversation."""
    assert len(live_workers(fleet, "encoder")) >= 2, fleet.procs
    conv = Conversation(fleet.url, "enc-killed-0")
    for text in CONVERSATION[:2]:
        conv.say(text, max_tokens=MAX_TOKENS)
    victim = _served(fleet.run_dir, "enc-killed-0")[-1]["worker"]
    fleet.kill(victim)
    failures, waited = _say_until_served(conv, CONVERSATION[2], within_s=90)
    print(f"encoder failover: {failures} failed tries, served after {waited:.1f} s")
    for text in CONVERSATION[3:]:
        conv.say(text, max_tokens=MAX_TOKENS)
    served = _served(fleet.run_dir, "enc-killed-0")
    assert len(served) == len(CONVERSATION)  # every failed try left no turn behind
    assert served[2]["rebuilt"] and served[2]["worker"] != victim  # rebuilt from the resent conversation elsewhere
    # the whole conversation, from position 0
    assert served[2]["new_tokens"] > sum(len(t["tokens"]) for t in served[:2])
    assert not any(t["rebuilt"] for t in served[3:]) and {t["worker"] for t in served[2:]} == {served[2]["worker"]}
    # as if undisturbed
    assert [t["tokens"] for t in served] == _reference_turns(reference, "ref-enc-killed-0", CONVERSATION)
