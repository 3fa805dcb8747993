"""Adapters: PEFT layout, placement rules, the bank (mixed batches, hot replace), shared history and replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from build_engines.verify.replay_check import ReplayExperiment
from ced.conversation import Conversation
from ced.lora import (
    AdapterBank,
    AdapterError,
    adapter_hash,
    decoder_lora_modules,
    random_adapter_weights,
    save_adapter,
)
from ced.model.network import CEDNetwork


def _adapter_dir(net: CEDNetwork, root: Path, name: str, select, rank: int = 4, include_20: bool = True) -> Path:  # type: ignore[no-untyped-def]
    mods = {k: v for k, v in decoder_lora_modules(net.cfg, net, include_20).items() if select(k)}
    return save_adapter(root / name, random_adapter_weights(mods, rank, std=0.05), rank, 2.0 * rank, net.cfg.name)


def _encoder_side_dir(net: CEDNetwork, root: Path) -> Path:
    """An adapter on layer 20's attention (compressor and indexer included) plus decoder modules."""
    E = net.cfg.first_decoder_layer
    mods = {n: m for n, m in net.named_modules()
            if isinstance(m, torch.nn.Linear) and n.startswith(f"layers.{E}.attn.") and not n.endswith("wo_a")}
    mods.update({k: v for k, v in decoder_lora_modules(net.cfg, net).items() if ".attn." in k})
    return save_adapter(root / "leaky", random_adapter_weights(mods, 4, std=0.05), 4, 8.0, net.cfg.name)


def test_fnv1a_hash_is_31_bit_with_zero_reserved() -> None:
    assert adapter_hash("a") == 0xE40C292C & 0x7FFFFFFF
    assert adapter_hash("adapters/L2_code") == adapter_hash("adapters/L2_code") != adapter_hash("adapters/L1_agent")
    assert all(0 < adapter_hash(f"p{i}") < 2**31 for i in range(200))


@torch.no_grad()
def test_bank_applies_per_row_and_keeps_base_weights(net: CEDNetwork, tmp_path: Path) -> None:
    enc, dec = net.split()
    before = {k: v.clone() for k, v in dec.state_dict().items()}
    bank = AdapterBank(net.cfg, dec)
    bank.attach(dec)
    a = bank.load(_adapter_dir(net, tmp_path, "attn", lambda k: ".attn." in k))
    b = bank.load(_adapter_dir(net, tmp_path, "ffn", lambda k: ".ffn." in k, rank=8))
    assert bank.names() == ["attn", "ffn"] and bank.get(a.hash) is a
    assert all(torch.equal(v, dec.state_dict()[k]) for k, v in before.items()), "no base weight is modified or copied"
    assert a.nbytes() < sum(v.numel() * 4 for v in before.values()) / 10
    tokens = torch.randint(0, net.cfg.vocab_size, (3, 150))
    handover, _ = enc(tokens, enc.new_state(3))
    alone = []
    for row, adapter in enumerate([a, None, b]):
        single, _ = enc(tokens[row : row + 1], enc.new_state(1))
        with AdapterBank.rows([adapter]):
            alone.append(dec(single, dec.new_state(1)).logits[0])
    with AdapterBank.rows([a, None, b]):
        mixed = dec(handover, dec.new_state(3)).logits
    for row in range(3):
        torch.testing.assert_close(mixed[row], alone[row], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(alone[0], alone[1]) and not torch.allclose(alone[2], alone[1])


@torch.no_grad()
def test_no20_and_full_placements_both_load_and_act(net: CEDNetwork, tmp_path: Path) -> None:
    E = net.cfg.first_decoder_layer
    bank = AdapterBank(net.cfg, net)
    bank.attach(net)
    full = bank.load(_adapter_dir(net, tmp_path, "full", lambda k: ".ffn." in k))
    no20 = bank.load(_adapter_dir(net, tmp_path, "no20", lambda k: True, include_20=False))
    assert any(m.startswith(f"layers.{E}.ffn.") for m in full.modules)
    assert not any(m.startswith(f"layers.{E}.") for m in no20.modules)
    tokens = torch.randint(0, net.cfg.vocab_size, (1, 140))
    outs = {}
    for adapter in (None, full, no20):
        with AdapterBank.rows([adapter]):
            outs[adapter and adapter.name] = net(tokens).logits
    assert not torch.equal(outs[None], outs["full"]) and not torch.equal(outs[None], outs["no20"])


def test_refused_placement_names_every_offending_module(net: CEDNetwork, tmp_path: Path) -> None:
    bank = AdapterBank(net.cfg, net)
    with pytest.raises(AdapterError, match=r"adapter 'leaky' refused: modules on the encoder side") as info:
        bank.load(_encoder_side_dir(net, tmp_path))
    for module in ("layers.4.attn.wq_a", "layers.4.attn.compressor.wkv", "layers.4.attn.indexer.wq_b",
                   "layers.4.attn.indexer.wk"):
        assert f"'{module}'" in str(info.value)
    assert "layers.5.attn" not in str(info.value)
    enc_mod = {"layers.1.ffn.experts.0.w1": dict(net.named_modules())["layers.1.ffn.experts.0.w1"]}
    with pytest.raises(AdapterError, match=r"\['layers.1.ffn.experts.0.w1'\]"):
        bank.load(save_adapter(tmp_path / "enc", random_adapter_weights(enc_mod, 2), 2, 4.0, "x"))
    assert len(bank) == 0, "a refused adapter leaves the bank unchanged"


@pytest.mark.parametrize(
    "corrupt, message",
    [
        ("rank", r"has A \(4, 64\) / B \(\d+, 4\), expected \(8, 64\) / \(\d+, 8\) for rank 8"),
        ("nan", r"layers.5.attn.wq_a holds NaN or Inf"),
        ("missing_module", r"target modules that do not exist: \['layers.5.attn.nonexistent'\]"),
        ("lonely_a", r"layers.5.attn.wq_a lacks lora_B"),
        ("not_targeted", r"layers.5.attn.wq_a is not in target_modules"),
        ("wo_a", r"grouped projection used through its weight\): \['layers.5.attn.wo_a'\]"),
    ],
)
def test_bad_adapters_get_clear_errors(net: CEDNetwork, tmp_path: Path, corrupt: str, message: str) -> None:
    path = _adapter_dir(net, tmp_path, "bad", lambda k: k.startswith("layers.5.attn."))
    weights_file, config_file = path / "adapter_model.safetensors", path / "adapter_config.json"
    tensors, config = load_file(str(weights_file)), json.loads(config_file.read_text())
    key = "base_model.model.layers.5.attn.wq_a.lora_A.weight"
    if corrupt == "rank":
        config["r"] = 8
    elif corrupt == "nan":
        tensors[key] = torch.full_like(tensors[key], float("nan"))
    elif corrupt == "missing_module":
        tensors["base_model.model.layers.5.attn.nonexistent.lora_A.weight"] = torch.zeros(4, 64)
        tensors["base_model.model.layers.5.attn.nonexistent.lora_B.weight"] = torch.zeros(64, 4)
        config["target_modules"].append("layers.5.attn.nonexistent")
    elif corrupt == "lonely_a":
        del tensors["base_model.model.layers.5.attn.wq_a.lora_B.weight"]
    elif corrupt == "not_targeted":
        config["target_modules"].remove("layers.5.attn.wq_a")
    elif corrupt == "wo_a":
        tensors["base_model.model.layers.5.attn.wo_a.lora_A.weight"] = torch.zeros(4, 128)
        tensors["base_model.model.layers.5.attn.wo_a.lora_B.weight"] = torch.zeros(64, 4)
        config["target_modules"].append("layers.5.attn.wo_a")
    save_file(tensors, str(weights_file))
    config_file.write_text(json.dumps(config))
    bank = AdapterBank(net.cfg, net)
    with pytest.raises(AdapterError, match=message):
        bank.load(path)


def test_unknown_adapter_lists_loaded_ones(net: CEDNetwork, tmp_path: Path) -> None:
    bank = AdapterBank(net.cfg, net)
    bank.load(_adapter_dir(net, tmp_path, "L2_code", lambda k: ".ffn." in k))
    with pytest.raises(AdapterError,
                       match=r"unknown adapter name 'L9' ; loaded adapters: \['L2_code'\]".replace(" ;", ";")):
        bank.get("L9")
    with pytest.raises(AdapterError, match="unknown adapter hash 12345"):
        bank.get(12345)
    assert bank.resolve(0) is None and bank.resolve("") is None
    bank.unload("L2_code")
    with pytest.raises(AdapterError, match="unknown adapter name 'L2_code'"):
        bank.get("L2_code")
    with pytest.raises(AdapterError, match="must hold adapter_config.json"):
        bank.load(tmp_path / "nowhere")


@torch.no_grad()
def test_all_sources_give_bitwise_identical_logits_for_a_fixed_target(net: CEDNetwork, tmp_path: Path) -> None:
    bank = AdapterBank(net.cfg, net)
    adapters = {
        "BASE": None,
        "attn": bank.load(_adapter_dir(net, tmp_path, "attn", lambda k: ".attn." in k)),
        # different module set
        "ffn_random": bank.load(_adapter_dir(net, tmp_path, "ffn_random", lambda k: ".ffn." in k, rank=8)),
    }
    assert not set(adapters["attn"].modules) & set(adapters["ffn_random"].modules)
    exp = ReplayExperiment(net, adapters)
    prompt = torch.randint(0, net.cfg.vocab_size, (1, 150))
    turn = torch.randint(0, net.cfg.vocab_size, (1, 12))
    pairs, _ = exp.run(prompt, 20, turn, 10, progress=False)
    assert len(pairs) == 9
    for target in adapters:
        logits = [p.logits for p in pairs if p.target == target]
        assert all(torch.equal(logits[0], other) for other in logits[1:]), target
    by_target = {p.target: p.logits for p in pairs}
    assert not torch.equal(by_target["BASE"], by_target["attn"]), "targets do differ"


@torch.no_grad()
def test_lora_on_layer20_attention_leaves_a_trace_of_the_source(net: CEDNetwork, tmp_path: Path) -> None:
    bank = AdapterBank(net.cfg, net, enforce_placement=False)
    leaky = bank.load(_encoder_side_dir(net, tmp_path))
    adapters = {"BASE": None, "leaky": leaky}
    exp = ReplayExperiment(net, adapters, adapter_on_encoder=True)
    prompt = torch.randint(0, net.cfg.vocab_size, (1, 150))
    turn = torch.randint(0, net.cfg.vocab_size, (1, 12))
    pairs, _ = exp.run(prompt, 10, turn, 8, targets=["BASE"], progress=False)
    from_base, from_leaky = (p.logits for p in pairs)
    assert not torch.equal(from_base, from_leaky), "the global KV written under the source differs"


@torch.no_grad()
def test_replay_covering_the_whole_context_equals_the_oracle_exactly(net: CEDNetwork, tmp_path: Path) -> None:
    bank = AdapterBank(net.cfg, net)
    target = bank.load(_adapter_dir(net, tmp_path, "t", lambda k: True))
    enc, dec = net.split()
    for model in (net, dec):
        bank.attach(model)
    tokens = torch.randint(0, net.cfg.vocab_size, (1, 260))
    conv = Conversation(enc, dec, replay_window=1000)
    conv.adapter = bank.load(_adapter_dir(net, tmp_path, "source", lambda k: ".ffn." in k))
    conv.extend(tokens)
    replayed = conv.replay(target).logits
    with AdapterBank.rows([target]):
        oracle = net(tokens).logits
    assert torch.equal(replayed, oracle)


@torch.no_grad()
def test_hot_replacement_keeps_shared_state_and_in_flight_version(net: CEDNetwork, tmp_path: Path) -> None:
    enc, dec = net.split()
    bank = AdapterBank(net.cfg, dec)
    bank.attach(dec)
    path = _adapter_dir(net, tmp_path, "L1_agent", lambda k: ".attn." in k)
    v1 = bank.load(path)
    sessions = [Conversation(enc, dec) for _ in range(3)]
    for i, conv in enumerate(sessions):
        conv.new_turn(torch.randint(0, net.cfg.vocab_size, (1, 140 + i)), v1 if i != 1 else None)
    snapshots = [(conv.encoder_state.clone(), conv.decoder.fork()) for conv in sessions]
    in_flight = sessions[0].fork()
    next_token = torch.randint(0, net.cfg.vocab_size, (1, 1))
    # a new version of the same path replaces v1 in the bank
    save_adapter(path, random_adapter_weights({k: v for k, v in decoder_lora_modules(net.cfg, dec).items()
                                               if ".attn." in k}, 4, std=0.05), 4, 8.0, net.cfg.name)
    v2 = bank.load(path)
    assert v2.hash == v1.hash and v2.version != v1.version and bank.get("L1_agent") is v2
    for conv, (enc_snap, dec_snap) in zip(sessions, snapshots):
        assert conv.encoder_state.equal(enc_snap) and conv.decoder.shared_equal(dec_snap)
    old = in_flight.step(next_token).logits  # finishes on the version it started with
    reference = sessions[0].fork()
    assert torch.equal(old, reference.step(next_token).logits)
    sessions[0].replay(v2)  # moving to the new version is a bounded replay, nothing else
    new = sessions[0].step(next_token).logits
    assert not torch.equal(new, old)
