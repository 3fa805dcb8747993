"""DSpark on a tensor-parallel decoder (issue 51): the ranks return each position's `draft_main` row with their step,
the leader runs the drafter graph alone with the drafter and the target's embedding and head, never the layers.

In process, over the main job's scripted conversation (routed turns, an explicit adapter): a TP=2 pipeline drafting
with DSpark gives the tokens of a single-rank pipeline without drafting, and it drafts and accepts exactly what the
single-rank torch engine drafting with DSpark does, adapter by adapter (the ranks' rows and the leader's drafts are the
single-rank ones; a difference in either would change the counts).
"""

from __future__ import annotations

import pytest

from tests.conftest import EMBEDDED
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.clients.scripted import CONVERSATION
from tritonserver_backend.core import counters as k
from tritonserver_backend.core.drafting import DSparkDrafter, make_drafter
from tritonserver_backend.core.pipeline import InProcessPipeline
from tritonserver_backend.sampling.sampler import SamplingParams

pytestmark = pytest.mark.slow
TOKENS = 24
BLOCK = 5
ADAPTERS = ("base", "L0_chat", "L1_agent", "L2_code", "L3_design")


def _replies(pipe: InProcessPipeline) -> list[list[int]]:
    return [pipe.chat("drafting", text, adapter=adapter, new_session=i == 0,
                      params=SamplingParams(max_tokens=TOKENS)).token_ids
            for i, (adapter, text) in enumerate(CONVERSATION)]


def _drafting(pipe: InProcessPipeline) -> dict[tuple[str, str], int]:
    return {(c, a): pipe.counters.get(c, a) for c in (k.SPECULATIVE_BLOCKS, k.DRAFTED, k.DRAFTS_ACCEPTED)
            for a in ADAPTERS}


def test_a_tensor_parallel_decoder_drafts_with_dspark(tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "registry"
    ensure_registry(root, EMBEDDED)
    plain = InProcessPipeline(EMBEDDED, root, max_context=2048)
    single = InProcessPipeline(EMBEDDED, root, max_context=2048)
    single.drafter = make_drafter("dspark", BLOCK, single.engine)
    parallel = InProcessPipeline(EMBEDDED, root, max_context=2048, tensor_parallel_size=2)
    try:
        parallel.drafter = make_drafter("auto", BLOCK, parallel.engine)  # what a server's default picks
        assert isinstance(parallel.drafter, DSparkDrafter)
        want = _replies(plain)
        assert _replies(single) == want
        assert _replies(parallel) == want
        drafted = _drafting(parallel)
        assert sum(v for (c, _), v in drafted.items() if c == k.DRAFTS_ACCEPTED) > 0, drafted
        assert drafted == _drafting(single)
        # the leader drafted without loading the layers: its single-process engine opened the drafter (and the
        # router's pointer head), nothing else
        leader = parallel.engine._leader  # type: ignore[attr-defined]
        assert leader is not None and set(leader._runners) <= {"drafter", "pointer"}  # type: ignore[attr-defined]
    finally:
        parallel.engine.close()  # type: ignore[attr-defined]
