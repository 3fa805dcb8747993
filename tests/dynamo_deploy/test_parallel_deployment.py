"""A Dynamo deployment whose encoder and decoder workers each lead a tensor-parallel group of two ranks
(`scripts/dynamo_up.py --tensor-parallel-size 2`): a routed conversation through Dynamo's frontend gets the tokens of
the single-rank torch engine in process, the decoder drafts with DSpark (its leader runs the drafter graph:
test_speculative_workers' checks), and stopping the deployment leaves no rank behind.

One deployment serves the module's tests in file order; the last one stops it (a test that needs its ranks alive
comes before)."""

from __future__ import annotations

from typing import Iterator

import pytest

from dynamo_deploy.client import Conversation
from dynamo_deploy.launcher import Deployment
from tests.conftest import EMBEDDED
from tests.dynamo_deploy.conftest import deploy
from tests.dynamo_deploy.test_deployment import CONVERSATION, MAX_TOKENS, _reference_turns, _served
from tests.dynamo_deploy.test_speculative_workers import check_drafting
from tests.tritonserver_backend.test_serving_parallel import assert_exit, rank_workers
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.core.pipeline import InProcessPipeline

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, default_engines) -> Iterator[Deployment]:  # type: ignore[no-untyped-def]
    """1x1 on the torch engine, two ranks per worker; DSpark named (what `auto` picks on these engines too), so the
    drafting test cannot pass on a decoder that does not draft."""
    d = deploy(tmp_path_factory.mktemp("dynamo-tp2"), default_engines, backend="torch", tensor_parallel_size=2,
               speculative="dspark")
    try:
        yield d
    finally:
        d.stop()


def _leaders(d: Deployment) -> list[int]:
    return [d.procs["encoder-0"].pid, d.procs["decoder-0"].pid]


def test_tensor_parallel_workers_serve_the_single_rank_tokens(tp2, tmp_path_factory) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("single_rank_registry")
    ensure_registry(root, EMBEDDED)
    single_rank = InProcessPipeline(EMBEDDED, root, max_context=2048)  # the torch engine, one process
    expected = _reference_turns(single_rank, "ref-parallel", CONVERSATION)
    conv = Conversation(tp2.url, "parallel-0")
    for text in CONVERSATION:
        conv.say(text, max_tokens=MAX_TOKENS)
    served = _served(tp2.run_dir, "parallel-0")
    assert [t["tokens"] for t in served] == expected
    assert len({t["adapter_hash"] for t in served}) > 1, "the router chose more than one adapter along the way"
    assert [len(rank_workers(pid)) for pid in _leaders(tp2)] == [1, 1], "each worker leads one more rank"


def test_a_drafting_decoder_of_two_ranks_serves_the_single_server_tokens(tp2, reference) -> None:  # type: ignore[no-untyped-def]
    """test_speculative_workers' checks (DSpark), on the decoder whose ranks return the `draft_main` rows."""
    check_drafting(tp2, "dspark", reference, tag="dspark-tp2")


def test_stopping_the_deployment_leaves_no_rank(tp2) -> None:  # type: ignore[no-untyped-def]
    """Last in the module: it stops the shared deployment (the fixture's own stop is then a no-op)."""
    ranks = [pid for leader in _leaders(tp2) for pid in rank_workers(leader)]
    assert len(ranks) == 2, ranks  # what the stop must take down
    tp2.stop()
    assert_exit(ranks, "a rank outlived its worker")
