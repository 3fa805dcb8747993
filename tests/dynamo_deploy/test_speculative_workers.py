"""Speculative decoding in the Dynamo decoder workers (issue 51): drafts verified in one decoder step, each step's kept
length carried to the session's encoder worker with the next step call, the Triton path's switches and counters.

Through Dynamo's frontend, on one deployment per drafter (`check_drafting`; DSpark on a decoder of two
tensor-parallel ranks, whose leader runs the drafter graph, `engines/parallel_engine.py`, is checked on
test_parallel_deployment's deployment): a routed conversation with adapter switches and an explicit adapter gives the
single-server path's tokens (greedy), the decoders count the blocks they verified, a turn that opts out
(`mol2-speculative:off`) drafts nothing, and a seeded sampled turn gives the plain draw.
"""

from __future__ import annotations

import pytest

from dynamo_deploy.client import Conversation
from dynamo_deploy.launcher import Deployment, counter_totals
from dynamo_deploy.model_ids import model_id
from dynamo_deploy.requests import SPECULATIVE_OFF
from tests.dynamo_deploy.conftest import deploy
from tests.dynamo_deploy.test_deployment import CONVERSATION, _served
from tritonserver_backend.core import counters as k
from tritonserver_backend.core.pipeline import InProcessPipeline
from tritonserver_backend.sampling.sampler import SamplingParams

pytestmark = pytest.mark.slow
MAX_TOKENS = 32
EXPLICIT = "L2_code"  # one turn names an adapter (it wins over routing)


def _decoder_counts(deployment: Deployment) -> dict[str, float]:
    return counter_totals([w for w in deployment.stats().values() if w["role"] == "decoder"],
                          (k.SPECULATIVE_BLOCKS, k.DRAFTED, k.DRAFTS_ACCEPTED))


def _reference(pipe: InProcessPipeline, session: str, adapters: list[str | None]) -> list[list[int]]:
    return [pipe.chat(session, text, adapter=adapter, new_session=(i == 0),
                      params=SamplingParams(max_tokens=MAX_TOKENS)).token_ids
            for i, (text, adapter) in enumerate(zip(CONVERSATION, adapters))]


def check_drafting(d: Deployment, drafter: str, reference: InProcessPipeline, tag: str | None = None) -> None:
    """The module's checks on a deployment whose decoders draft with `drafter`, under session ids named by `tag`
    (default: the drafter). Counters are read as differences, so the deployment may have served other turns before
    (a shared one: dynamo_1x1, test_parallel_deployment's)."""
    tag = tag or drafter
    adapters = [None, None, EXPLICIT, None, None]
    start = _decoder_counts(d)
    conv = Conversation(d.url, f"spec-{tag}")
    for text, adapter in zip(CONVERSATION, adapters):
        conv.model = model_id(adapter) if adapter else model_id(None)
        conv.say(text, max_tokens=MAX_TOKENS)
    served = _served(d.run_dir, f"spec-{tag}")
    assert [t["tokens"] for t in served] == _reference(reference, f"ref-spec-{tag}", adapters)
    assert len({t["adapter_hash"] for t in served}) > 1 and not any(t["rebuilt"] for t in served)
    drafted = {key: n - start[key] for key, n in _decoder_counts(d).items()}  # this conversation's
    assert drafted[k.SPECULATIVE_BLOCKS] > 0 and drafted[k.DRAFTED] > 0, drafted
    if drafter == "dspark":  # the default's drafter agrees with its target often (docs/speculative.md)
        assert drafted[k.DRAFTS_ACCEPTED] > 0, drafted

    # a turn that opts out drafts nothing, and a seeded sampled turn is the plain draw either way
    plain = Conversation(d.url, f"plain-{tag}", annotations=[SPECULATIVE_OFF])
    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 7}
    plain.say(CONVERSATION[0], max_tokens=MAX_TOKENS)
    before = _decoder_counts(d)
    plain.say(CONVERSATION[1], max_tokens=MAX_TOKENS, **sampled)
    assert _decoder_counts(d) == before
    drafted_conv = Conversation(d.url, f"drafted-{tag}")
    drafted_conv.say(CONVERSATION[0], max_tokens=MAX_TOKENS)
    drafted_conv.say(CONVERSATION[1], max_tokens=MAX_TOKENS, **sampled)
    assert _decoder_counts(d)[k.SPECULATIVE_BLOCKS] > before[k.SPECULATIVE_BLOCKS]
    assert ([t["tokens"] for t in _served(d.run_dir, f"drafted-{tag}")]
            == [t["tokens"] for t in _served(d.run_dir, f"plain-{tag}")])


@pytest.mark.parametrize("drafter", ["dspark", "ngram"])
def test_drafting_decoders_serve_the_single_server_tokens(drafter, tmp_path, default_engines, reference,  # type: ignore[no-untyped-def]
                                                         request) -> None:
    if drafter == "dspark":  # DSpark is the default ("auto": the default's engines hold a drafter): the shared 1x1
        check_drafting(request.getfixturevalue("dynamo_1x1"), drafter, reference)
        return
    d = deploy(tmp_path / f"dynamo-{drafter}", default_engines, speculative=drafter)
    try:
        check_drafting(d, drafter, reference)
    finally:
        d.stop()
