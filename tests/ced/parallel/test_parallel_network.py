"""Tensor / expert parallel reference network (issue 30, step 1): the layout, slice reads, and real gloo ranks.

The multi-process tests spawn two CPU ranks (about 4 s of start-up each: a fresh interpreter imports torch), so they
carry the `slow` marker; the layout and reader tests run in-process. Every rank and the test process use one thread.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ced.formats.checkpoint import CheckpointFiles, load_checkpoint, save_checkpoint, write_synthetic_release
from ced.model.config import CEDConfig
from ced.model.engram import engram_table_rows
from ced.model.network import CEDNetwork
from ced.parallel import ParallelLayout, ParallelLayoutError, sharding_plan
from ced.parallel.comm import Comm
from ced.parallel.launch import RankFailed, run_ranks
from ced.parallel.layout import held_numel
from ced.parallel.network import ParallelCEDNetwork, load_parallel_network
from ced.parallel.shards import SliceReader
from tests.tiny import tiny_config, tiny_network

torch.set_num_threads(1)

BATCH, PROMPT, STEPS = 2, 40, 8
TOLERANCE = 1e-4
ENGRAM = dict(engram_layers=(1, 2), engram_vocab_size=97, engram_max_ngram=4, engram_n_heads=2, engram_head_dim=32)


def parallel_config(**overrides: object) -> CEDConfig:
    """The tiny config with Engram tables (row-sharded), a 16-token window (the ring wraps within the test), and
    top-k / candidate pools smaller than the context, so the all-reduced indexer scores really choose entries."""
    fields: dict[str, object] = dict(ENGRAM, engram_num_embeddings=engram_table_rows(SimpleNamespace(**ENGRAM)),
                                     engram_compressed_vocab_size=300, window_size=16, index_topk=8,
                                     candidate_topk_blocks=2, candidate_block_size=4)
    fields.update(overrides)
    return tiny_config(**fields)


def _prompt(cfg: CEDConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (BATCH, PROMPT), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def _greedy(net: CEDNetwork, prompt: torch.Tensor, steps: int) -> dict:
    """Prefill, then `steps` one-token decode steps on the argmax; logits of every step and the decode traffic."""
    out = net(prompt)
    logits, tokens = [out.logits], []
    for step in range(steps):
        if step == steps - 1 and isinstance(net, ParallelCEDNetwork):
            net.comm.reset_traffic()  # the last decode step's communication alone
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(nxt)
        out = net(nxt, out.state)
        logits.append(out.logits)
    return dict(logits=logits, tokens=torch.cat(tokens, 1))


def _rank_greedy(rank: int, world: int, directory: Path, expert_parallel: bool, prompt: torch.Tensor) -> dict:
    net = load_parallel_network(directory, Comm(), expert_parallel=expert_parallel)
    result = _greedy(net, prompt, STEPS)
    result.update(held=net.held_bytes(), read=net.bytes_read, traffic=dict(net.comm.traffic))
    return result


def _rank_dies(rank: int, world: int, directory: Path, prompt: torch.Tensor) -> None:
    net = load_parallel_network(directory, Comm())
    with torch.no_grad():
        out = net(prompt)
        if rank == 1:
            os._exit(3)  # mid-generation: rank 0 is about to wait for it in the next collective
        for _ in range(STEPS):
            out = net(out.logits[:, -1].argmax(-1, keepdim=True), out.state)


def _rank_raises(rank: int, world: int) -> None:
    if rank == 0:
        raise ValueError("rank zero is unhappy")
    torch.distributed.barrier()  # blocks until rank 0's death releases it (or the parent kills it)


REDUCED_SIZES = (5, 4099, 300_000)


def _reduction_data(rank: int) -> list[torch.Tensor]:
    """Rank-dependent values spanning many magnitudes, so the order of a sum shows in its rounding."""
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(n, generator=g) * 10 ** (3 * torch.randn(n, generator=g)) for n in REDUCED_SIZES]


def _rank_reductions(rank: int, world: int) -> list[torch.Tensor]:
    """The ordered and the backend's (gloo) all-reduce, each twice."""
    data = _reduction_data(rank)
    return [Comm(ordered=ordered).all_reduce(t, "x") for ordered in (True, False, True, False) for t in data]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(1234)
    return save_checkpoint(tiny_network(parallel_config()), tmp_path_factory.mktemp("tp_checkpoint"))


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> dict:
    return _greedy(load_checkpoint(checkpoint), _prompt(parallel_config()), STEPS)


@pytest.fixture(scope="module")
def tp2(checkpoint: Path) -> list[dict]:
    return run_ranks(_rank_greedy, 2, (checkpoint, False, _prompt(parallel_config())), timeout_s=120)


def _assert_matches(results: list[dict], reference: dict) -> None:
    for rank, result in enumerate(results):
        assert len(result["logits"]) == len(reference["logits"]) == STEPS + 1
        for step, (got, want) in enumerate(zip(result["logits"], reference["logits"])):
            assert got.shape == want.shape
            err = float((got - want).abs().max())
            assert err < TOLERANCE, f"rank {rank}, step {step}: max |logit difference| {err:.3g}"
        assert torch.equal(result["tokens"], reference["tokens"]), f"rank {rank}: another greedy continuation"
    for result in results[1:]:  # every rank ends with bitwise the same (gathered) logits
        assert all(torch.equal(a, b) for a, b in zip(result["logits"], results[0]["logits"]))


# ---------------------------------------------------------------------- real ranks


@pytest.mark.slow
def test_tensor_parallel_matches_single_process(tp2: list[dict], reference: dict) -> None:
    _assert_matches(tp2, reference)


@pytest.mark.slow
def test_expert_parallel_matches_single_process(checkpoint: Path, reference: dict) -> None:
    results = run_ranks(_rank_greedy, 2, (checkpoint, True, _prompt(parallel_config())), timeout_s=120)
    _assert_matches(results, reference)


@pytest.mark.slow
def test_rerun_is_bitwise_identical(tp2: list[dict], checkpoint: Path) -> None:
    again = run_ranks(_rank_greedy, 2, (checkpoint, False, _prompt(parallel_config())), timeout_s=120)
    for first, second in zip(tp2, again):
        assert all(torch.equal(a, b) for a, b in zip(first["logits"], second["logits"]))


@pytest.mark.slow
def test_each_rank_holds_only_its_shards(tp2: list[dict]) -> None:
    """Held bytes are exactly the layout's shard of every tensor; that is the replicated tensors plus half of the
    sharded ones (up to the uneven ceil split of the Engram tables), well below the whole network."""
    cfg = parallel_config()
    whole = sum(held_numel(sharding_plan(cfg, ParallelLayout(1, 0))))
    replicated, _ = held_numel(sharding_plan(cfg, ParallelLayout(2, 0)))
    for rank, result in enumerate(tp2):
        want = 4 * sum(held_numel(sharding_plan(cfg, ParallelLayout(2, rank))))
        assert result["held"] == want
        assert abs(result["held"] - 4 * (replicated + (whole - replicated) / 2)) <= 4 * 32 * len(cfg.engram_layers)
        assert result["held"] < 0.7 * 4 * whole
        # column slices read their rows in blocks: disk bytes stay under the whole checkpoint
        assert result["held"] <= result["read"] < 4 * whole


@pytest.mark.slow
def test_decode_traffic_follows_the_formula(tp2: list[dict]) -> None:
    """Payload bytes per rank of one decode step (B=2, S=1), per collective, as documented in network.py."""
    cfg, B, N = parallel_config(), BATCH, 2
    context = PROMPT + STEPS
    n_cols = (cfg.engram_max_ngram - 1) * cfg.engram_n_heads
    want = {
        "embed": 4 * B * cfg.dim,
        "engram": 4 * B * n_cols * cfg.engram_head_dim * len(cfg.engram_layers),
        "attn": 4 * B * cfg.dim * cfg.n_layers,
        "ffn": 4 * B * cfg.dim * cfg.n_layers,
        "index": 4 * B * sum(context // cfg.compress_ratios[l] for l in cfg.index_source_layers),
        "head": 4 * B * cfg.vocab_size // N,
    }
    for result in tp2:
        assert result["traffic"] == want


@pytest.mark.slow
def test_collectives_are_deterministic_and_the_same_on_every_rank() -> None:
    """Both reduction modes give every rank bitwise the same sum, and the same sum again when repeated; the ordered
    one is exactly the rank-order sum (3 ranks: not a power of two, so no butterfly symmetry helps)."""
    results = run_ranks(_rank_reductions, 3, timeout_s=120)
    for result in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(result, results[0]))
    k = len(REDUCED_SIZES)
    ordered, native, ordered_again, native_again = (results[0][i * k:(i + 1) * k] for i in range(4))
    assert all(torch.equal(a, b) for a, b in zip(ordered + native, ordered_again + native_again))
    parts = [_reduction_data(rank) for rank in range(3)]
    for i, n in enumerate(REDUCED_SIZES):
        assert torch.equal(ordered[i], parts[0][i] + parts[1][i] + parts[2][i]), n


@pytest.mark.slow
def test_a_dead_rank_fails_the_launch_quickly(checkpoint: Path) -> None:
    started = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 of 2 died \(exit code 3\)") as failure:
        run_ranks(_rank_dies, 2, (checkpoint, _prompt(parallel_config())), timeout_s=120, group_timeout_s=60)
    assert failure.value.rank == 1 and failure.value.exitcode == 3
    assert time.monotonic() - started < 40, "the launcher waited for a peer of the dead rank"


@pytest.mark.slow
def test_a_raising_rank_is_reported_with_its_traceback() -> None:
    started = time.monotonic()
    with pytest.raises(RankFailed, match=r"(?s)rank 0 of 2 raised:.*ValueError: rank zero is unhappy"):
        run_ranks(_rank_raises, 2, timeout_s=60, group_timeout_s=30)
    assert time.monotonic() - started < 30


# ---------------------------------------------------------------------- in-process


@pytest.mark.parametrize("world, expert_parallel, overrides, key", [
    (3, False, {}, "vocab_size=512"),
    (4, False, {}, "o_groups=2"),
    (2, False, dict(moe_inter_dim=31), "moe_inter_dim=31"),
    (2, True, dict(n_routed_experts=3), "n_routed_experts=3"),
    (8, False, dict(n_heads=8, o_groups=8, index_n_heads=4), "index_n_heads=4"),
    (2, False, dict(runtime_fake_quant=True), "moe_inter_dim / N (routed w2 input)=16"),
])
def test_a_layout_that_does_not_divide_is_refused_by_name(world: int, expert_parallel: bool, overrides: dict,
                                                           key: str) -> None:
    cfg = tiny_config(**overrides)
    layout = ParallelLayout(world, 0, expert_parallel)
    with pytest.raises(ParallelLayoutError, match=re.escape(key)):
        layout.check(cfg)
    with pytest.raises(ValueError, match="cannot run"):
        ParallelCEDNetwork(cfg, layout, _fake_comm(world, 0))


def test_a_rank_outside_the_group_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rank=2 must lie in 0..1"):
        ParallelLayout(2, 2)


def _fake_comm(world: int, rank: int) -> Comm:
    """A Comm that claims a group (for building on the meta device only; its collectives are never called)."""
    comm = Comm()
    comm.world, comm.rank = world, rank
    return comm


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_the_ranks_shards_partition_every_tensor(expert_parallel: bool) -> None:
    """Per tensor: split slices tile the axis once, an owned expert has one owner, and each rank's network (meta
    device) holds exactly the planned names at the planned shapes."""
    cfg, N = parallel_config(), 2
    plans = [sharding_plan(cfg, ParallelLayout(N, r, expert_parallel)) for r in range(N)]
    for name, (shard, shape) in plans[0].items():
        shards = [plan[name][0] for plan in plans]
        if shard.kind == "split":
            assert [(s.start, s.stop) for s in shards] == sorted((s.start, s.stop) for s in shards)
            assert shards[0].start == 0 and shards[-1].stop == shape[shard.dim]
            assert all(a.stop == b.start for a, b in zip(shards, shards[1:])), name
        elif shard.kind == "owned":
            assert expert_parallel and ("experts." in name), name
            assert sum(s.held for s in shards) == 1, name
        else:
            assert all(s.kind == "replicated" for s in shards), name
    for rank, plan in enumerate(plans):
        net = ParallelCEDNetwork(cfg, ParallelLayout(N, rank, expert_parallel), _fake_comm(N, rank))
        own = {k: tuple(v.shape) for k, v in net.state_dict().items()}
        assert own == {k: s.local_shape(shape) for k, (s, shape) in plan.items() if s.held}


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_slices_of_a_quantized_release_equal_slices_of_whole_reads(tmp_path: Path, expert_parallel: bool) -> None:
    """fp8 blocks and packed fp4 experts: slices read with their scale slices (aligned) or from a whole read
    (unaligned, e.g. a 16-row slice of 32-row blocks) dequantize to exactly the whole tensor's slice."""
    cfg = tiny_config()
    directory = write_synthetic_release(cfg, tmp_path, extras=False)
    files = CheckpointFiles(directory)
    for rank in range(2):
        reader = SliceReader(files)
        for name, (shard, shape) in sharding_plan(cfg, ParallelLayout(2, rank, expert_parallel)).items():
            if not shard.held:
                continue
            got = torch.empty(shard.local_shape(shape))
            reader.read_into(name, shard, shape, got)
            want = files.read_float(name)
            if shard.kind == "split":
                want = want.narrow(shard.dim, shard.start, shard.stop - shard.start)
            assert torch.equal(got, want), name
