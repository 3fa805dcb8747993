"""A Dynamo deployment whose encoder and decoder workers each lead a tensor-parallel group of two ranks
(`scripts/dynamo_up.py --tensor-parallel-size 2`): a routed conversation through Dynamo's frontend gets the tokens of
the single-rank torch engine in process, and stopping the deployment leaves no rank behind."""

from __future__ import annotations

import pytest

from dynamo_deploy.client import Conversation
from tests.conftest import EMBEDDED
from tests.dynamo_deploy.test_deployment import CONVERSATION, MAX_TOKENS, _deploy, _reference_turns, _served
from tests.tritonserver_backend.test_serving_parallel import assert_exit, rank_workers
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.core.pipeline import InProcessPipeline

pytestmark = pytest.mark.slow


def test_tensor_parallel_workers_serve_the_single_rank_tokens(tmp_path, tmp_path_factory, default_engines) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("single_rank_registry")
    ensure_registry(root, EMBEDDED)
    single_rank = InProcessPipeline(EMBEDDED, root, max_context=2048)  # the torch engine, one process
    expected = _reference_turns(single_rank, "ref-parallel", CONVERSATION)
    d = _deploy(tmp_path, default_engines, encoders=1, decoders=1, backend="torch", tensor_parallel_size=2)
    leaders, ranks = [d.procs["encoder-0"].pid, d.procs["decoder-0"].pid], []
    try:
        conv = Conversation(d.url, "parallel-0")
        for text in CONVERSATION:
            conv.say(text, max_tokens=MAX_TOKENS)
        served = _served(d.run_dir, "parallel-0")
        assert [t["tokens"] for t in served] == expected
        assert len({t["adapter_hash"] for t in served}) > 1, "the router chose more than one adapter along the way"
        ranks = [pid for leader in leaders for pid in rank_workers(leader)]
        assert [len(rank_workers(pid)) for pid in leaders] == [1, 1], "each worker leads one more rank"
    finally:
        d.stop()
    assert_exit(ranks, "a rank outlived its worker")
