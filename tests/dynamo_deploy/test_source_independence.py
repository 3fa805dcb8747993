"""Source independence on the Dynamo path (real processes: Dynamo's frontend, an encoder worker and a decoder worker
on the ONNX engines): turn 2 under a target adapter after turn 1 under adapter A equals, bit for bit in its tokens'
log-probabilities, turn 2 of a session the encoder rebuilds from the identical messages, whatever A was.

Every turn of this module asks for its tokens' log-probabilities (`logprobs`), so `turns.jsonl` keeps each served
token's log-probability: the bits the decoder worker computed, compared here, not only the few tokens a client sees.
A turn with log-probabilities is never drafted, so on the shared 1x1 deployment (conftest.py, DSpark on) these turns
run as on a deployment started with `--record-logprobs`, which turns drafting off for every turn.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from dynamo_deploy.client import Conversation
from dynamo_deploy.launcher import Deployment, read_turns
from dynamo_deploy.model_ids import model_id

pytestmark = pytest.mark.slow

FIRST = "def mean(xs):\n    return sum(xs) / len(xs)"
SECOND = "Make the header sticky with a shadow."
SOURCES = ("base", "L0_chat", "L2_code")
TARGET = "L3_design"
RECORDED = {"logprobs": True}  # each turn's token log-probabilities, kept in turns.jsonl (and no drafting)


@pytest.fixture(scope="module")
def fleet(dynamo_1x1: Deployment) -> Deployment:
    return dynamo_1x1  # tests/dynamo_deploy/conftest.py: shared with the other 1x1 modules


def _say(conv: Conversation, text: str, max_tokens: int) -> dict[str, Any]:
    return conv.say(text, max_tokens=max_tokens, **RECORDED)


def _turn(fleet, session: str, index: int) -> dict:  # type: ignore[no-untyped-def]
    turns = [t for t in read_turns(fleet.run_dir) if t["session"] == session]
    assert len(turns) > index, f"{session}: {len(turns)} turns logged"
    return turns[index]


@pytest.mark.parametrize("others", [0, 4], ids=["alone", "beside-4-sessions"])
def test_the_turn_after_any_source_adapter_equals_a_rebuilt_session_on_dynamo(fleet, others: int) -> None:  # type: ignore[no-untyped-def]
    """With `others` > 0, that many sessions keep talking meanwhile: one decoder worker batches their turns with the
    probed ones."""
    stop, errors = threading.Event(), []

    def background(i: int) -> None:
        conv = Conversation(fleet.url, f"dyn-load-{others}-{i}")
        for n in range(30):  # bounded: at most 30 turns a session
            if stop.is_set():
                return
            try:
                _say(conv, f"Question {n}: how do I sort a list?", max_tokens=12)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return

    threads = [threading.Thread(target=background, args=(i,)) for i in range(others)]
    for t in threads:
        t.start()
    try:
        histories = {source: _pair(fleet, f"{others}-{source}", source) for source in SOURCES}
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)
    assert not errors, errors
    assert len(set(histories.values())) > 1, "the source adapters wrote different histories"
    if others:
        batched = [t for t in read_turns(fleet.run_dir) if t["session"].startswith(f"dyn-load-{others}-")]
        assert len(batched) >= others, "the other sessions were served meanwhile"


def _pair(fleet, tag: str, source: str) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    """Turn 1 under `source`, turn 2 under TARGET, and TARGET's turn on a session rebuilt from the same messages:
    the two turn-2s agree bit for bit. -> the tokens of turn 1 (the history the source wrote)."""
    conv = Conversation(fleet.url, f"dyn-{tag}", model=model_id(source))
    _say(conv, FIRST, max_tokens=8)
    conv.model = model_id(TARGET)
    _say(conv, SECOND, max_tokens=6)
    rebuilt = Conversation(fleet.url, f"dyn-rebuilt-{tag}", messages=list(conv.messages[:2]), model=model_id(TARGET))
    _say(rebuilt, SECOND, max_tokens=6)
    first, got, want = (_turn(fleet, f"dyn-{tag}", 0), _turn(fleet, f"dyn-{tag}", 1),
                        _turn(fleet, f"dyn-rebuilt-{tag}", 0))
    assert first["explicit"] == source and got["explicit"] == want["explicit"] == TARGET
    assert not got["rebuilt"] and want["rebuilt"], "the continued turn replays; the other session is rebuilt"
    assert got["prompt_tokens"] == want["prompt_tokens"], "the rebuilt session holds the same history"
    assert got["tokens"] == want["tokens"] and len(got["logprobs"]) == len(got["tokens"]) > 0, source
    np.testing.assert_array_equal(np.asarray(got["logprobs"], np.float32).view(np.uint32),
                                  np.asarray(want["logprobs"], np.float32).view(np.uint32), err_msg=f"after {source}")
    return tuple(first["tokens"])
