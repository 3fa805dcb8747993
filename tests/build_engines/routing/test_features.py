"""Per-token H19 cache (`build_engines.routing.features`): the poolings are the reductions they claim, and the mean of
the cached positions is the pooled H19 `train.extract_h19` computes (first and later turns), so ceilings measured on
the cache describe the features the router is trained and served on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from build_engines.routing.features import POOLINGS, TokenFeatures, extract_h19_tokens
from build_engines.routing.train import extract_h19
from ced.model.network import EncoderEngine
from ced.text.tokenizer import ChatTokenizer, Message, train_tokenizer
from tests.build_engines.routing.test_router_baselines import SENTENCES
from tests.tiny import tiny_config, tiny_network


def test_poolings_are_per_item_reductions() -> None:
    rng = np.random.default_rng(0)
    lengths = [3, 1, 5]
    values = rng.standard_normal((sum(lengths), 4)).astype(np.float16)
    tf = TokenFeatures(values, np.concatenate([[0], np.cumsum(lengths)]))
    items = [tf.item(i).astype(np.float32) for i in range(len(tf))]
    expected = {"mean": [x.mean(0) for x in items], "max": [x.max(0) for x in items], "last": [x[-1] for x in items]}
    expected["meanmax"] = [np.concatenate([a, b]) for a, b in zip(expected["mean"], expected["max"])]
    expected["meanlast"] = [np.concatenate([a, b]) for a, b in zip(expected["mean"], expected["last"])]
    assert set(expected) == set(POOLINGS)
    for kind in POOLINGS:
        np.testing.assert_allclose(tf.pool(kind), np.stack(expected[kind]), rtol=1e-5, atol=1e-5)
    x, mask = tf.padded(max_len=2)
    assert x.shape == (3, 2, 4) and mask.sum(1).tolist() == [2, 1, 2]
    np.testing.assert_allclose(x[2].numpy(), items[2][-2:])  # long turns keep their last positions
    with pytest.raises(ValueError, match="pooling"):
        tf.pool("median")


@torch.no_grad()
def test_cached_positions_pool_to_the_router_features(tmp_path: Path) -> None:
    tok: ChatTokenizer = train_tokenizer(SENTENCES, 300, tmp_path / "tok" / "tokenizer.json")
    net = tiny_network(tiny_config(vocab_size=tok.vocab_size))
    encoder = EncoderEngine.from_state_dict(net.cfg, net.state_dict()).eval()
    queries = SENTENCES[:5]
    histories = [[Message("user", SENTENCES[-1]), Message("assistant", SENTENCES[-2][: 7 * (i + 1)])] for i in range(5)]
    for hist in (None, histories):
        pooled = extract_h19(encoder, tok, queries, tmp_path / "pooled", "d", batch=2, histories=hist)
        tokens = extract_h19_tokens(encoder, tok, queries, tmp_path / "tokens", "d", histories=hist, batch=3)
        assert len(tokens) == len(queries)
        np.testing.assert_allclose(tokens.pool("mean"), pooled, rtol=2e-3, atol=2e-3)  # float16 positions
        again = extract_h19_tokens(encoder, tok, queries, tmp_path / "tokens", "d", histories=hist)  # from the cache
        assert np.array_equal(again.values, tokens.values) and np.array_equal(again.offsets, tokens.offsets)
