"""Answer fine-tuning on a tiny network: batches carry the served prompt unmasked only on the answer, the tuned
adapter keeps the source's rank and modules, a finished run is recognised and skipped, and a changed record
restarts instead of resuming someone else's state."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from build_engines.data.token_data import Mixture
from build_engines.training.answer_stage import keep_domain_adapter, training_seconds
from build_engines.training.answer_tuning import (
    STAGE_KEY,
    AnswerSettings,
    PairBatches,
    encode_pair,
    is_done,
    stage_record,
    tune_adapter,
)
from build_engines.training.build_default import merge_previous
from build_engines.training.train import trainable_adapter
from ced.lora import save_adapter
from ced.lora.peft_io import ADAPTER_CONFIG
from ced.text.tokenizer import train_tokenizer
from tests.tiny import tiny_network

TEXTS = ["what does the -r option of grep do? -r: it will search recursively", "display: it sets how it is shown"] * 30


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return train_tokenizer(TEXTS, 300, tmp_path_factory.mktemp("tok") / "tokenizer.json")


def _source_adapter(net, directory: Path) -> Path:  # type: ignore[no-untyped-def]
    adapter = trainable_adapter(net, "L1_agent", "adapters/L1_agent", 4, 8.0, True, 1)
    weights = {m: (a.detach(), torch.randn_like(b) * 0.01) for m, (a, b) in adapter.weights.items()}
    save_adapter(directory, weights, 4, 8.0, "tiny", {"mol2_name": "L1_agent", "mol2_description": "shell tools"})
    return directory


def test_batches_mask_only_the_answer(tok) -> None:  # type: ignore[no-untyped-def]
    pair = encode_pair(tok, "what does -r do?", "-r: it will search recursively", 64)
    text = Mixture({"t": np.arange(5, 200, dtype=np.int32)}, {"t": 1.0})
    settings = AnswerSettings(pair_rows=2, text_rows=1, seq_len=32)
    batch = PairBatches([pair], text, settings, tok.pad_id).batch(np.random.default_rng(0), 3, 32)
    assert batch.shape == (2, 3, 33)
    n = len(pair[0])
    assert batch[0, 0, :n].tolist() == pair[0] and batch[1, 0, :n].tolist() == pair[1]
    assert (batch[0, 0, n:] == tok.pad_id).all() and (batch[1, 0, n:] == 0).all()
    assert (batch[1, 2] == 1).all()
    with pytest.raises(ValueError):
        PairBatches([pair], text, settings, tok.pad_id).batch(np.random.default_rng(0), 4, 32)


def test_tune_adapter_keeps_size_skips_when_done_and_restarts_on_a_new_record(tok, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    net = tiny_network()
    source = _source_adapter(net, tmp_path / "source" / "L1_agent")
    pairs = [encode_pair(tok, t.split("?")[0] + "?", t.split("?")[-1], 48) for t in TEXTS[:4]]
    text = Mixture({"t": np.asarray(tok.encode(" ".join(TEXTS)), dtype=np.int32)}, {"t": 1.0})
    settings = AnswerSettings(steps=3, pair_rows=2, text_rows=1, seq_len=24, warmup=1)
    record = stage_record(source, settings, "pairs-digest")
    out = tmp_path / "out" / "L1_agent"
    assert not is_done(out, record)
    history = tune_adapter(net, source, "L1_agent", pairs, text, settings, tmp_path / "work", out, record, tok.pad_id)
    assert len(history) == 3 and all(np.isfinite(h["loss"]) for h in history)
    cfg, src = json.loads((out / ADAPTER_CONFIG).read_text()), json.loads((source / ADAPTER_CONFIG).read_text())
    assert cfg["r"] == src["r"] and cfg["target_modules"] == src["target_modules"]
    assert cfg["mol2_description"] == "shell tools" and cfg[STAGE_KEY] == record
    assert (out / "adapter_model.safetensors").stat().st_size == (source / "adapter_model.safetensors").stat().st_size
    assert (out / "adapter_model.safetensors").read_bytes() != (source / "adapter_model.safetensors").read_bytes()
    assert is_done(out, record) and not is_done(out, {**record, "pairs_sha256": "other"})
    # the same record resumes the finished state (no new step); another record starts over
    again = tune_adapter(net, source, "L1_agent", pairs, text, settings, tmp_path / "work", out, record, tok.pad_id)
    assert again == history
    other = {**record, "pairs_sha256": "other"}
    fresh = tune_adapter(net, source, "L1_agent", pairs, text, settings, tmp_path / "work", out, other, tok.pad_id)
    assert len(fresh) == 3 and fresh[0]["seconds"] != history[0]["seconds"]


def test_domain_adapter_is_kept_before_it_is_replaced(tmp_path: Path) -> None:
    net = tiny_network()
    model_adapter = _source_adapter(net, tmp_path / "model" / "L1_agent")
    keep = tmp_path / "keep" / "L1_agent"
    assert keep_domain_adapter(model_adapter, keep) == keep
    assert ((keep / "adapter_model.safetensors").read_bytes()
            == (model_adapter / "adapter_model.safetensors").read_bytes())
    cfg = json.loads((model_adapter / ADAPTER_CONFIG).read_text())
    (model_adapter / ADAPTER_CONFIG).write_text(json.dumps(cfg | {STAGE_KEY: {"stage": "answers"}}))
    assert keep_domain_adapter(model_adapter, keep) == keep  # answer-tuned in the model: start from the kept copy
    with pytest.raises(FileNotFoundError, match="already answer-tuned"):
        keep_domain_adapter(model_adapter, tmp_path / "nothing" / "L1_agent")


def test_training_seconds_add_up_across_resumed_runs() -> None:
    history = [{"seconds": 1.0}, {"seconds": 2.0}, {"seconds": 0.5}, {"seconds": 1.5}]
    assert training_seconds(history) == pytest.approx(3.5)


def test_incremental_rebuild_keeps_the_previous_timings(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"notes": ["n"], "timings_s": {"tokenizer_s": 4.0, "base_training_s": 100.0},
                                "wall_s": 104.0}))
    merged = merge_previous(path, {"timings_s": {"tokenizer_s": 0.1, "answers_L0_chat_s": 50.0, "evaluation_s": 9.0},
                                   "wall_s": 60.0})
    assert merged["notes"] == ["n"]
    assert merged["timings_s"] == {"tokenizer_s": 4.0, "base_training_s": 100.0, "answers_L0_chat_s": 50.0,
                                   "evaluation_s": 9.0}
    assert merged["wall_s"] == pytest.approx(163.0)
