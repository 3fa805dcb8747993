"""The reference network: incremental == one pass, causality, rings, compressor, indexer, engine split."""

from __future__ import annotations

import pytest
import torch

from ced.model.attention import (
    StepContext,
    candidate_entry_mask,
    select_candidate_blocks,
    select_top,
    visible_entries,
)
from ced.model.network import CEDNetwork
from ced.model.primitives import rope_angles
from ced.model.state import SourceCache, WindowRing
from tests.tiny import tiny_config, tiny_network

LENGTH = 3 * 128 + 45  # past three windows, and long enough that every top-k and the candidate pool select


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


TIE = 1e-6  # scores closer than this (relative to the row's largest) may be ordered either way by float rounding


class _Selections:
    """Records every `select_top` call (scores, chosen indices) of the network, in call order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import ced.model.attention as attention

        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        original = attention.select_top

        def recording(scores: torch.Tensor, k: int) -> torch.Tensor:
            chosen = original(scores, k)
            self.calls.append((scores.clone(), chosen.clone()))
            return chosen

        monkeypatch.setattr(attention, "select_top", recording)

    def take(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        calls, self.calls = self.calls, []
        return calls


def _first_near_tie_flips(full_calls: list, chunk_calls: list[list], cuts: list[int], rows: int) -> list[int]:
    """Per batch row, the first position where the chunked pass chose other entries than the one pass (LENGTH where
    none did). A differing choice must be a near-tie: every swapped entry's one-pass score within TIE of the k-th
    best; anything else fails the test. A row's later positions are not compared (the flip changes what follows)."""
    first = [LENGTH] * rows
    for (a, _), calls in zip(zip(cuts[:-1], cuts[1:]), chunk_calls):
        assert len(calls) == len(full_calls), "the chunked pass made other selections than the one pass"
        for (full_scores, full_chosen), (_, chosen) in zip(full_calls, calls):
            for row in range(rows):
                for s in range(chosen.shape[1]):
                    pos = a + s
                    if pos >= first[row]:
                        break
                    want, got = set(full_chosen[row, pos].tolist()), set(chosen[row, s].tolist())
                    if want == got:
                        continue
                    scores = full_scores[row, pos]
                    kth = scores[full_chosen[row, pos][-1]] if full_chosen[row, pos][-1] >= 0 else float("-inf")
                    scale = float(scores[torch.isfinite(scores)].abs().max())
                    gap = max((float((scores[i] - kth).abs()) for i in want ^ got if i >= 0), default=float("inf"))
                    assert gap <= TIE * scale, (
                        f"row {row} position {pos}: selection differs by more than a tie ({gap:.3g})")
                    first[row] = pos
    return first


@torch.no_grad()
def test_incremental_matches_one_pass(net: CEDNetwork, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked and token-by-token computation give the one pass's logits (to float rounding). Top-k selection can
    order two scores that differ by float rounding either way; such a near-tie (checked on the scores) ends the
    comparison of that row at that position, and at most one row may have one."""
    cfg = net.cfg
    tokens = torch.randint(0, cfg.vocab_size, (2, LENGTH))
    selections = _Selections(monkeypatch)
    full = net(tokens).logits
    full_calls = selections.take()
    # a prefill chunk, a long chunk crossing a window boundary, then token-by-token decode
    cuts = [0, 97, 97 + 150, *range(97 + 151, LENGTH + 1)]
    state, parts, chunk_calls = net.new_state(2), [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        out = net(tokens[:, a:b], state)
        state = out.state
        parts.append(out.logits)
        chunk_calls.append(selections.take())
    incremental = torch.cat(parts, 1)
    assert state.position == LENGTH
    compared = _first_near_tie_flips(full_calls, chunk_calls, cuts, 2)
    assert LENGTH in compared, f"near-ties in both rows: {compared}"
    for row, upto in enumerate(compared):
        assert upto > 0 and _relative_error(incremental[row, :upto], full[row, :upto]) < 1e-5
    # the top-k really selected (fewer entries attended than visible), so the test covers sparse selection
    assert state.sources[cfg.first_decoder_layer].n_entries == LENGTH > cfg.index_topk


@torch.no_grad()
def test_changing_a_future_token_never_changes_a_past_logit(net: CEDNetwork) -> None:
    tokens = torch.randint(0, net.cfg.vocab_size, (1, 300))
    t = int(torch.randint(150, 299, ()))
    changed = tokens.clone()
    changed[0, t] = (changed[0, t] + 1 + int(torch.randint(0, net.cfg.vocab_size - 1, ()))) % net.cfg.vocab_size
    a, b = net(tokens).logits, net(changed).logits
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.equal(a[:, t], b[:, t])


def test_window_ring_wraps_around() -> None:
    ring = WindowRing.empty(1, 8, 2)
    pos = torch.arange(0, 11)
    ring = ring.write(torch.arange(11.0).view(1, 11, 1).expand(1, 11, 2), pos)
    # positions 3..10 survive; slot = position % 8
    assert sorted(ring.pos[0].tolist()) == list(range(3, 11))
    assert ring.pos[0, 10 % 8] == 10 and ring.pos[0, 3] == 3
    assert torch.equal(ring.kv[0, :, 0], ring.pos[0].float())
    ring = ring.write(torch.full((1, 1, 2), 11.0), torch.tensor([11]))
    assert ring.pos[0, 3] == 11 and 3 not in ring.pos[0].tolist()


@torch.no_grad()
def test_ring_state_after_decode_holds_last_window(net: CEDNetwork) -> None:
    tokens = torch.randint(0, net.cfg.vocab_size, (1, 200))
    state = net(tokens[:, :190]).state
    for i in range(190, 200):
        state = net(tokens[:, i : i + 1], state).state
    for layer, ring in state.windows.items():
        assert sorted(ring.pos[0].tolist()) == list(range(200 - 128, 200)), layer


@torch.no_grad()
def test_compressor_pools_pairs_and_carries_the_odd_token(seed: int) -> None:
    net = tiny_network()
    attn = net.layers["2"].attn
    comp = attn.compressor
    x = torch.randn(1, 7, net.cfg.dim)
    empty = SourceCache.empty(1, net.cfg.head_dim, net.cfg.index_head_dim)
    latent, pending_kv, _ = comp(x, empty)
    assert latent.shape[1] == 3 and pending_kv.shape[1] == 1  # groups (0,1) (2,3) (4,5); token 6 waits
    kv, gate = comp.wkv(x).float(), comp.wgate(x).float()
    w = torch.softmax(gate[:, 2:4], dim=1)
    expected = comp.norm((kv[:, 2:4] * w).sum(1))
    torch.testing.assert_close(latent[:, 1], expected, rtol=0, atol=1e-6)
    # token by token gives the same entries as one chunk
    cache, parts = empty, []
    for i in range(7):
        out, pk, ps = comp(x[:, i : i + 1], cache)
        parts.append(out)
        cache = SourceCache(cache.kv, cache.index_k, pk, ps)
    torch.testing.assert_close(torch.cat(parts, 1), latent, rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_compressed_entry_visible_only_after_its_last_token(net: CEDNetwork) -> None:
    vis = visible_entries(torch.arange(6), 3, ratio=2)
    assert vis.tolist() == [[False] * 3, [True, False, False], [True, False, False], [True, True, False],
                            [True, True, False], [True, True, True]]
    # in the network: the ratio-2 source writes entry j only when token 2j+1 is processed
    tokens = torch.randint(0, net.cfg.vocab_size, (1, 9))
    state = net.new_state()
    for i in range(9):
        state = net(tokens[:, i : i + 1], state).state
        assert state.sources[2].n_entries == (i + 1) // 2
        assert state.sources[2].pending_kv.shape[1] == (i + 1) % 2
        assert state.sources[4].n_entries == i + 1


def test_select_top_pads_and_breaks_ties_by_index() -> None:
    inf = float("inf")
    scores = torch.tensor([[0.0, 2.0, 0.0, -inf, 1.0, 0.0]])
    assert select_top(scores, 4).tolist() == [[1, 4, 0, 2]]
    assert select_top(scores, 8).tolist() == [[1, 4, 0, 2, 5, -1, -1, -1]]


def test_candidate_pool_pins_the_newest_block() -> None:
    inf = float("inf")
    # 12 entries in blocks of 4; the query at position 9 (ratio 1) sees entries 0..9, newest block = 2 (entries 8..11)
    scores = torch.tensor([[[5.0, 0, 0, 0, 3.0, 0, 0, 0, -1.0, -2.0, -inf, -inf]]])
    positions = torch.tensor([9])
    pool = select_candidate_blocks(scores, positions, ratio=1, block=4, n_blocks=2)
    assert pool.tolist() == [[[2, 0]]]  # block 2 pinned despite the lowest score; block 0 best of the rest
    mask = candidate_entry_mask(pool, 12, 4)
    assert mask[0, 0].tolist() == [True] * 4 + [False] * 4 + [True] * 4
    # with fewer visible blocks than asked for, the pool pads with -1
    assert select_candidate_blocks(scores[..., :4], torch.tensor([2]), 1, 4, 3).tolist() == [[[0, -1, -1]]]


@torch.no_grad()
def test_indexer_topk_in_network_only_selects_visible_entries(net: CEDNetwork) -> None:
    cfg = net.cfg
    tokens = torch.randint(0, cfg.vocab_size, (1, 300))
    enc, _ = net.split()
    handover, _ = enc(tokens, enc.new_state())
    topk = handover.topk[0]  # layer 4's selection per position
    positions = handover.positions
    for p in (0, 31, 32, 200, 299):
        chosen = [i for i in topk[p].tolist() if i >= 0]
        assert len(chosen) == min(cfg.index_topk, p + 1)
        assert max(chosen) <= p  # ratio 1: entries up to the query's own position
    newest_block = positions // cfg.candidate_block_size
    assert bool((handover.candidates[0] == newest_block.unsqueeze(1)).any(1).all()), "newest block always in the pool"


@torch.no_grad()
def test_reindex_layer_scores_against_first_decoder_layers_keys(net: CEDNetwork) -> None:
    cfg = net.cfg
    E, R = cfg.first_decoder_layer, 6
    assert cfg.is_reindex_layer(R)
    attn = net.layers[str(R)].attn
    assert not hasattr(attn.indexer, "wk") and not hasattr(attn.indexer, "k_norm"), "re-index layers own no keys"
    S, N = 3, 80
    positions = torch.arange(N - S, N)
    keys = torch.randn(1, N, cfg.index_head_dim)
    candidates = torch.tensor([[[9, 0, 4, -1, -1, -1, -1, -1]] * S])
    x = torch.randn(1, S, cfg.dim)
    qr = attn.q_norm(attn.wq_a(x))
    cos, sin = rope_angles(positions, attn.inv_freq)

    def run(index_k: torch.Tensor) -> torch.Tensor:
        ctx = StepContext(positions,
                          {E: SourceCache(torch.zeros(1, N, cfg.head_dim), index_k, torch.zeros(1, 0, cfg.head_dim),
                                          torch.zeros(1, 0, cfg.head_dim))}, candidates=candidates)
        attn._select(x, qr, ctx, cos, sin)
        return ctx.topk

    topk = run(keys)
    expected_scores = attn.indexer.scores(x, qr, keys, cos, sin, cfg.rope_head_dim, False)
    allowed = candidate_entry_mask(candidates, N, cfg.candidate_block_size) & visible_entries(positions, N, 1)
    expected = select_top(expected_scores.masked_fill(~allowed, float("-inf")), cfg.index_topk)
    assert torch.equal(topk, expected)
    chosen = topk[topk >= 0]
    assert bool(((chosen // cfg.candidate_block_size).unsqueeze(-1) == torch.tensor([9, 0, 4])).any(-1).all())
    assert not torch.equal(run(torch.randn_like(keys)), topk), "the selection follows layer E's keys"


@torch.no_grad()
def test_encoder_then_decoder_equals_whole_network_bitwise(net: CEDNetwork) -> None:
    cfg = net.cfg
    tokens = torch.randint(0, cfg.vocab_size, (2, 2 * 128 + 41))
    enc, dec = net.split()
    assert not set(enc.state_dict()) & set(dec.state_dict()), "components own disjoint parameters"
    assert set(enc.state_dict()) | set(dec.state_dict()) == set(net.state_dict())
    whole_state, enc_state, dec_state = net.new_state(2), enc.new_state(2), dec.new_state(2)
    for a, b in [(0, 200), (200, 201), (201, 202), (202, tokens.shape[1])]:
        whole = net(tokens[:, a:b], whole_state, trace=True)
        handover, enc_state = enc(tokens[:, a:b], enc_state)
        split = dec(handover, dec_state, trace=True)
        dec_state = split.state
        whole_state = whole.state
        assert torch.equal(split.logits, whole.logits)
        assert torch.equal(handover.encoder_out, whole.hidden[cfg.first_decoder_layer - 1])
        for l, h in enumerate(split.hidden, start=cfg.first_decoder_layer):
            assert torch.equal(h, whole.hidden[l])
    E = cfg.first_decoder_layer
    assert torch.equal(dec_state.sources[E].kv, whole_state.sources[E].kv)
    assert torch.equal(dec_state.sources[E].index_k, whole_state.sources[E].index_k)
    for l in range(E + 1, cfg.n_layers):
        assert torch.equal(dec_state.windows[l].kv, whole_state.windows[l].kv)


@torch.no_grad()
def test_decoder_refuses_a_handover_at_the_wrong_position(net: CEDNetwork) -> None:
    enc, dec = net.split()
    tokens = torch.randint(0, net.cfg.vocab_size, (1, 10))
    handover, _ = enc(tokens, enc.new_state())
    with pytest.raises(ValueError, match="hand-over starts at position 0 but the decoder state is at 10"):
        dec(handover, dec(handover, dec.new_state()).state)


@torch.no_grad()
def test_state_clone_is_independent_and_measured(net: CEDNetwork) -> None:
    tokens = torch.randint(0, net.cfg.vocab_size, (1, 140))
    state = net(tokens).state
    copy = state.clone()
    assert copy.equal(state) and copy.nbytes() == state.nbytes() > 0
    net(tokens[:, :1], copy)  # a step never mutates the state it was given
    assert copy.equal(state)
    E = net.cfg.first_decoder_layer
    expected_global = 140 * net.cfg.head_dim * 4 + 140 * net.cfg.index_head_dim * 4
    assert state.sources[E].nbytes() == expected_global


@torch.no_grad()
def test_bad_tokens_are_refused(net: CEDNetwork) -> None:
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 512\)"):
        net(torch.tensor([[1, 512]]))
    with pytest.raises(ValueError, match="int32/int64 tensor of shape"):
        net(torch.tensor([[1.0, 2.0]]))
    small = CEDNetwork(tiny_config(max_seq_len=16))
    with pytest.raises(ValueError, match="more than max_seq_len=16"):
        small(torch.zeros(1, 17, dtype=torch.long))


@torch.no_grad()
def test_fake_quant_mode_runs_and_changes_numbers(seed: int) -> None:
    net = tiny_network()
    quant = CEDNetwork(tiny_config(runtime_fake_quant=True))
    quant.load_state_dict(net.state_dict())
    tokens = torch.randint(0, net.cfg.vocab_size, (1, 150))
    a, b = net(tokens).logits, quant.eval()(tokens).logits
    assert torch.isfinite(b).all() and not torch.equal(a, b)
    assert _relative_error(b, a) < 0.2
