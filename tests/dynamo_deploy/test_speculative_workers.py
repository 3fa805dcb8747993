"""Speculative decoding in the Dynamo decoder workers (issue 51): drafts verified in one decoder step, each step's kept
length carried to the session's encoder worker with the next step call, the Triton path's switches and counters.

Through Dynamo's frontend, on one deployment per drafter (and DSpark on a decoder of two tensor-parallel ranks,
whose leader runs the drafter graph: `engines/parallel_engine.py`): a routed conversation with adapter switches and
an explicit adapter gives the single-server path's tokens (greedy), the decoders count the blocks they verified, a
turn that opts out (`mol2-speculative:off`) drafts nothing, and a seeded sampled turn gives the plain draw.
"""

from __future__ import annotations

import pytest

from dynamo_deploy.client import Conversation
from dynamo_deploy.launcher import counter_totals
from dynamo_deploy.model_ids import model_id
from dynamo_deploy.requests import SPECULATIVE_OFF
from tests.dynamo_deploy.test_deployment import CONVERSATION, _deploy, _served
from tritonserver_backend.core import counters as k
from tritonserver_backend.core.pipeline import InProcessPipeline
from tritonserver_backend.sampling.sampler import SamplingParams

pytestmark = pytest.mark.slow
MAX_TOKENS = 32
EXPLICIT = "L2_code"  # one turn names an adapter (it wins over routing)


def _decoder_counts(deployment) -> dict[str, float]:  # type: ignore[no-untyped-def]
    return counter_totals([w for w in deployment.stats().values() if w["role"] == "decoder"],
                          (k.SPECULATIVE_BLOCKS, k.DRAFTED, k.DRAFTS_ACCEPTED))


def _reference(pipe: InProcessPipeline, session: str, adapters: list[str | None]) -> list[list[int]]:
    return [pipe.chat(session, text, adapter=adapter, new_session=(i == 0),
                      params=SamplingParams(max_tokens=MAX_TOKENS)).token_ids
            for i, (text, adapter) in enumerate(zip(CONVERSATION, adapters))]


@pytest.mark.parametrize("drafter, tp", [("dspark", 1), ("ngram", 1), ("dspark", 2)],
                         ids=["dspark", "ngram", "dspark-tp2"])
def test_drafting_decoders_serve_the_single_server_tokens(drafter, tp, tmp_path, default_engines, reference,  # type: ignore[no-untyped-def]
                                                         request) -> None:
    parallel = {"backend": "torch", "tensor_parallel_size": tp} if tp > 1 else {}
    # DSpark on one rank is the default ("auto": the default's engines hold a drafter): the shared 1x1 deployment
    shared = drafter == "dspark" and tp == 1
    d = (request.getfixturevalue("dynamo_1x1") if shared else
         _deploy(tmp_path / f"dynamo-{drafter}", default_engines, encoders=1, decoders=1, speculative=drafter,
                 **parallel))
    try:
        adapters = [None, None, EXPLICIT, None, None]
        conv = Conversation(d.url, f"spec-{drafter}")
        for text, adapter in zip(CONVERSATION, adapters):
            conv.model = model_id(adapter) if adapter else model_id(None)
            conv.say(text, max_tokens=MAX_TOKENS)
        served = _served(d.run_dir, f"spec-{drafter}")
        assert [t["tokens"] for t in served] == _reference(reference, f"ref-spec-{drafter}", adapters)
        assert len({t["adapter_hash"] for t in served}) > 1 and not any(t["rebuilt"] for t in served)
        drafted = _decoder_counts(d)
        assert drafted[k.SPECULATIVE_BLOCKS] > 0 and drafted[k.DRAFTED] > 0, drafted
        if drafter == "dspark":  # the default's drafter agrees with its target often (docs/speculative.md)
            assert drafted[k.DRAFTS_ACCEPTED] > 0, drafted

        # a turn that opts out drafts nothing, and a seeded sampled turn is the plain draw either way
        plain = Conversation(d.url, f"plain-{drafter}", annotations=[SPECULATIVE_OFF])
        sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 7}
        plain.say(CONVERSATION[0], max_tokens=MAX_TOKENS)
        before = _decoder_counts(d)
        plain.say(CONVERSATION[1], max_tokens=MAX_TOKENS, **sampled)
        assert _decoder_counts(d) == before
        drafted_conv = Conversation(d.url, f"drafted-{drafter}")
        drafted_conv.say(CONVERSATION[0], max_tokens=MAX_TOKENS)
        drafted_conv.say(CONVERSATION[1], max_tokens=MAX_TOKENS, **sampled)
        assert _decoder_counts(d)[k.SPECULATIVE_BLOCKS] > before[k.SPECULATIVE_BLOCKS]
        assert ([t["tokens"] for t in _served(d.run_dir, f"drafted-{drafter}")]
                == [t["tokens"] for t in _served(d.run_dir, f"plain-{drafter}")])
    finally:
        if not shared:
            d.stop()

