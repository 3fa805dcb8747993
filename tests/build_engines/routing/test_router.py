"""MoL2 pointer head: cached option side, candidate masks, routing writes no state, a trained head beats chance."""

from __future__ import annotations

import torch

from build_engines.routing.train import TaskSet, accuracy, train_head
from ced.conversation import Conversation
from ced.routing.pointer_head import OptionCache, PointerHead, RouterConfig, pool_h19
from tests.tiny import tiny_network


def _head(dim: int = 64) -> PointerHead:
    return PointerHead(RouterConfig(model_dim=dim, width=32, heads=4)).eval()


@torch.no_grad()
def test_cached_option_side_equals_a_fresh_computation(seed: int) -> None:
    head = _head()
    options = [torch.randn(n, 64) for n in (3, 7, 5)]
    cache = head.encode_options(options)
    q = torch.randn(4, 64)
    cached = head.score(q, cache)
    for _ in range(2):
        assert torch.equal(cached, head.score(q, head.encode_options(options)))
    assert cached.shape == (4, 3)


def _score_with_module(head: PointerHead, q: torch.Tensor, cache: OptionCache,
                       option_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The pointer score with the cross-attention run by nn.MultiheadAttention itself (the oracle for the cached
    path)."""
    n, T, w = cache.tokens.shape
    x = head.query_proj(head.query_norm(q)).unsqueeze(1)
    mem = cache.tokens.reshape(1, n * T, w).expand(q.shape[0], -1, -1)
    pad = cache.padding.reshape(1, n * T).expand(q.shape[0], -1)
    if option_mask is not None:
        pad = pad | (~option_mask).unsqueeze(-1).expand(-1, n, T).reshape(q.shape[0], n * T)
    x = x + head.cross(head.cross_norm(x), mem, mem, key_padding_mask=pad, need_weights=False)[0]
    logits = (head.wq(x.squeeze(1)) @ cache.keys.t()) / w ** 0.5
    return logits if option_mask is None else logits.masked_fill(~option_mask, float("-inf"))


@torch.no_grad()
def test_cached_cross_attention_equals_the_attention_module(seed: int) -> None:
    """The per-request path (keys/values projected once into the cache) computes what nn.MultiheadAttention does."""
    head = _head()
    for p in head.parameters():  # break LayerNorm's identity init so every parameter matters
        p.add_(0.1 * torch.randn_like(p))
    cache = head.encode_options([torch.randn(n, 64) for n in (3, 7, 5, 1)])
    q = torch.randn(6, 64)
    torch.testing.assert_close(head.score(q, cache), _score_with_module(head, q, cache), rtol=1e-5, atol=1e-5)
    mask = torch.rand(6, 4) > 0.4
    mask[:, 1] = True
    torch.testing.assert_close(head.score(q, cache, mask), _score_with_module(head, q, cache, mask), rtol=1e-5,
                               atol=1e-5)
    assert cache.attn_query.shape == (32, 4 * 4 * 7) and cache.point_read.shape == (4 * 4 * 7, 4)


@torch.no_grad()
def test_option_mask_restricts_each_row_to_its_candidates(seed: int) -> None:
    head = _head()
    options = [torch.randn(4, 64) for _ in range(5)]
    q = torch.randn(2, 64)
    mask = torch.tensor([[True, False, True, False, True], [False, True, True, True, False]])
    masked = head.score(q, head.encode_options(options), mask)
    assert torch.isinf(masked[~mask]).all() and torch.isfinite(masked[mask]).all()
    # a row scored against its own subset equals the masked full-set score
    sub = head.score(q[:1], head.encode_options([options[i] for i in (0, 2, 4)]))
    torch.testing.assert_close(masked[0, [0, 2, 4]], sub[0], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_routing_reads_h19_and_writes_no_state(seed: int) -> None:
    net = tiny_network()
    enc, dec = net.split()
    conv = Conversation(enc, dec)
    handover = conv.extend(torch.randint(0, net.cfg.vocab_size, (1, 150)))
    before_enc, before_dec = conv.encoder_state.clone(), conv.decoder.fork()
    head = _head(net.cfg.dim)
    options = head.encode_options([net.embed.weight[torch.randint(0, 512, (6,))] for _ in range(4)])
    head.score(pool_h19(handover.encoder_out[:, -20:]), options).argmax(-1)
    assert conv.encoder_state.equal(before_enc) and conv.decoder.shared_equal(before_dec)


def test_trained_head_beats_chance_on_held_out_queries() -> None:
    """Three 'domains' of queries drawn from disjoint token ranges; H19 from the tiny network (seeded)."""
    torch.manual_seed(1)
    net = tiny_network()
    enc, _ = net.split()
    n_per, length = 100, 48

    def feats(domain: int, n: int) -> torch.Tensor:
        lo = 10 + domain * 150
        ids = torch.randint(lo, lo + 150, (n, length))
        with torch.no_grad():
            handover, _ = enc(ids, enc.new_state(n))
        return pool_h19(handover.encoder_out)

    train = torch.cat([feats(d, n_per) for d in range(3)])
    test = torch.cat([feats(d, 20) for d in range(3)])
    option_tokens = [torch.randint(0, 512, (5,)) for _ in range(3)]

    def taskset(x: torch.Tensor, n: int) -> TaskSet:
        answers = torch.arange(3).repeat_interleave(n)
        return TaskSet("toy", ["a", "b", "c"], x, torch.ones(len(x), 3, dtype=torch.bool), answers, option_tokens)

    head = PointerHead(RouterConfig(model_dim=net.cfg.dim, width=32, heads=4))
    embed = net.embed.weight.detach()
    losses = train_head(head, embed, [[taskset(train, n_per)]], [300], batch=32, lr=3e-3, seed=0, progress=False)
    acc = accuracy(head, embed, taskset(test, 20))
    assert losses[-1] < losses[0]
    assert acc >= 0.7, f"held-out accuracy {acc:.2f} (chance 0.33)"
