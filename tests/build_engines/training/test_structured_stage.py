"""The structured stage: the base's decoder learns, its embedding and encoder stay bit for bit (routing, cached
prefixes and journaled sessions read them), the streams are cached, and each adapter's mixture holds its kinds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from build_engines.data.token_data import Mixture
from build_engines.training.structured_stage import (
    ADAPTER_KINDS,
    STREAM_PREFIX,
    StructuredSettings,
    adapter_mixture,
    continue_base,
    structured_streams,
)
from ced.formats.checkpoint import load_checkpoint
from ced.text.chat_format import ChatFormat
from ced.text.tokenizer import ChatTokenizer
from tests.conftest import EMBEDDED


def test_continued_training_moves_the_decoder_and_nothing_below_it(tmp_path: Path) -> None:
    net = load_checkpoint(EMBEDDED)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    rng = np.random.default_rng(0)
    text = Mixture({"text": rng.integers(0, 8000, 4000).astype(np.int32)}, {"text": 1.0})
    structured = {f"{STREAM_PREFIX}json": rng.integers(0, 8000, 4000).astype(np.int32)}
    settings = StructuredSettings(steps=2, warmup=1)
    continue_base(net, text, structured, settings, batch=2, seq_len=32, work_dir=tmp_path / "work", seed=0)
    first_decoder = net.cfg.n_encoder_layers
    for name, p in net.named_parameters():
        below = name.startswith("embed") or (name.startswith("layers.") and int(name.split(".")[1]) < first_decoder)
        if below:
            assert torch.equal(p, before[name]), name
        assert p.requires_grad  # handed back trainable
    changed = [n for n, p in net.named_parameters() if not torch.equal(p, before[n])]
    assert any(n.startswith(f"layers.{first_decoder}.") for n in changed) and any(n.startswith("head") for n in changed)


@pytest.mark.slow
def test_streams_are_made_once_and_reused(tmp_path: Path, real_data: Path) -> None:
    data = Path(real_data)
    settings = StructuredSettings(counts={"json": 30, "tools": 10, "chit_chat": 10, "code": 5, "css": 5})
    first = structured_streams(EMBEDDED, data, tmp_path, settings, "digest")
    assert sorted(first) == sorted(f"{STREAM_PREFIX}{k}" for k in settings.counts)
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*.npy")}
    again = structured_streams(EMBEDDED, data, tmp_path, settings, "digest")
    assert all(np.array_equal(first[k], again[k]) for k in first)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.glob("*.npy")} == stamps


@pytest.mark.parametrize("domain", sorted(ADAPTER_KINDS))
def test_an_adapter_mixes_its_domain_with_its_own_structured_kinds(domain: str) -> None:
    streams = {"domain_text": np.arange(100, dtype=np.int32)}
    structured = {f"{STREAM_PREFIX}{k}": np.arange(50, dtype=np.int32)
                  for k in ("json", "tools", "chit_chat", "code", "css")}
    mixture = adapter_mixture(domain, streams, {"domain_text": 1.0}, structured, 0.3)
    probs = dict(zip(mixture.names, mixture.probs))
    assert probs["domain_text"] == pytest.approx(0.6 if domain == "agent" else 0.7)
    assert {n.removeprefix(STREAM_PREFIX) for n in probs if n != "domain_text"} == set(ADAPTER_KINDS[domain])


def test_a_changed_recipe_gets_its_own_resumable_state() -> None:
    """The stage's work folder is named after its record: a new recipe must not resume (or find finished) the old
    recipe's optimizer state, while a re-run of the same recipe resumes it."""
    assert StructuredSettings().work_key() == StructuredSettings().work_key()
    assert StructuredSettings().work_key() != StructuredSettings(steps=StructuredSettings().steps + 1).work_key()
    assert StructuredSettings().work_key() == StructuredSettings(adapter_share=0.3).work_key()  # adapters only


def test_the_committed_default_was_made_with_the_default_recipe() -> None:
    """The knobs added later (object_style_share, reply weights) record nothing while off, so the committed default's
    manifest still names the default recipe, and `build_default --force` on it retrains nothing."""
    recorded = json.loads((EMBEDDED / "manifest.json").read_text())["structured"]
    assert {k: v for k, v in recorded.items() if k not in ("adapters", "tokens")} == StructuredSettings().record()
    assert recorded["adapters"] == StructuredSettings().adapter_record()


def test_reply_weights_and_the_reply_style_are_part_of_the_recipe() -> None:
    ids = ChatTokenizer.load(EMBEDDED).special_ids
    plain, weighted = StructuredSettings(), StructuredSettings(reply_weight=3.0, first_token_weight=2.0)
    assert plain.reply_weights(ids) is None
    rw = weighted.reply_weights(ids)
    assert rw is not None and (rw.reply, rw.first, rw.opener) == (3.0, 2.0, ids["<|assistant|>"])
    assert weighted.work_key() != plain.work_key()
    assert weighted.adapter_record() != plain.adapter_record()  # the adapters are retrained with them
    styled = StructuredSettings(object_style_share=0.5)
    assert styled.work_key() != plain.work_key() and styled.stream_key() != plain.stream_key()


def test_continued_training_with_reply_weights_moves_the_decoder(tmp_path: Path) -> None:
    net = load_checkpoint(EMBEDDED)
    tok = ChatTokenizer.load(EMBEDDED)
    fmt = ChatFormat.load(EMBEDDED)
    convo = fmt.encode([{"role": "user", "content": "Give me the name as JSON."},
                        {"role": "assistant", "content": '{"name":"river"}'}], add_generation_prompt=False)
    structured = {f"{STREAM_PREFIX}json": np.asarray(convo * 40, dtype=np.int32)}
    text = Mixture({"text": np.asarray(tok.encode("a quiet river runs north " * 80), dtype=np.int32)}, {"text": 1.0})
    settings = StructuredSettings(steps=2, warmup=1, reply_weight=3.0, first_token_weight=2.0)
    head = net.head.weight.detach().clone()
    continue_base(net, text, structured, settings, batch=2, seq_len=32, work_dir=tmp_path / "work", seed=0,
                  reply_weights=settings.reply_weights(tok.special_ids))
    assert not torch.equal(net.head.weight, head)
