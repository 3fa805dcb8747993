"""The release directory as published: its own config.json keys, sharded index, lazy role-bounded reads, refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from build_engines.export.stored_role import load_stored_role, stored_bytes
from ced.formats.checkpoint import (
    INDEX_FILE,
    CheckpointError,
    CheckpointFiles,
    load_checkpoint,
    role_tensor_names,
    save_checkpoint,
    write_synthetic_release,
)
from ced.formats.config_file import load_config, load_config_and_extras
from ced.formats.release_config import to_release_dict
from ced.model.config import ConfigError, get_preset
from ced.model.network import CEDNetwork
from tests.tiny import TensorReads, tiny_config, tiny_network

OFFICIAL_CONFIG = Path(__file__).parent / "data" / "deepseek_v41_flash_inference_config.json"


def _official() -> dict:
    return json.loads(OFFICIAL_CONFIG.read_text())


def _release_dir(tmp_path: Path, data: dict) -> Path:
    d = tmp_path / "release"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(data))
    return d


def test_official_config_translates_to_the_flash_roles(tmp_path: Path) -> None:
    cfg, extras = load_config_and_extras(_release_dir(tmp_path, _official()))
    flash = get_preset("deepseek-v4.1-flash")
    for field in ("vocab_size", "dim", "n_layers", "n_encoder_layers", "n_heads", "head_dim", "rope_head_dim",
                  "q_lora_rank", "o_groups", "o_lora_rank", "window_size", "compress_ratios", "kv_source_layers",
                  "index_source_layers",
                  "candidate_source_layer", "candidate_topk_blocks", "candidate_block_size", "index_n_heads",
                  "index_head_dim", "index_topk", "n_routed_experts", "n_shared_experts", "n_activated_experts",
                  "moe_inter_dim", "route_scale", "swiglu_limit", "rope_theta", "compress_rope_theta",
                  "yarn_original_seq_len", "yarn_factor", "yarn_beta_fast", "yarn_beta_slow", "norm_eps", "hc_mult",
                  "hc_sinkhorn_iters", "hc_eps", "runtime_fake_quant"):
        assert getattr(cfg, field) == getattr(flash, field), field
    # the three DSpark entries are not backbone layers
    assert cfg.n_encoder_layers == 20 and len(cfg.compress_ratios) == 40
    assert cfg.engram_layers == (1, 14) and cfg.engram_num_embeddings == (384006168, 384016682)
    assert extras is not None and extras.n_mtp_layers == 3 and extras.vision and extras.dtype == "fp8"


def test_translation_round_trips_through_the_official_keys(tmp_path: Path) -> None:
    cfg, extras = load_config_and_extras(_release_dir(tmp_path, _official()))
    assert extras is not None
    written = to_release_dict(cfg, extras)
    assert set(written) <= set(_official()) | {"gate_temp", "norm_topk_prob"}
    assert {k: v for k, v in written.items() if k in _official()} == _official()


@pytest.mark.parametrize(("change", "named"), [
    ({"mystery_scale": 3}, "mystery_scale"),
    ({"score_func": "softmax"}, "score_func"),
    ({"dtype": "fp16"}, "dtype"),
    ({"expert_dtype": "fp8"}, "expert_dtype"),
    ({"compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 1]}, "draft-layer compress ratios"),
    ({"n_mtp_layers": 2}, "compress_ratios has 43 entries"),
    ({"kv_source_layers": [2, 8, 15, 20]}, "KV source layer 15 is not an index layer"),
    ({"engram_num_embeddings": [384006168, 384016683]}, "engram_num_embeddings"),
])
def test_a_bad_official_key_is_refused_by_name(tmp_path: Path, change: dict, named: str) -> None:
    with pytest.raises(CheckpointError, match=named) as info:
        load_config(_release_dir(tmp_path, {**_official(), **change}))
    assert isinstance(info.value, ConfigError)  # callers catching either kind see it


def test_a_hugging_face_root_config_reads_the_inference_config_beside_it(tmp_path: Path) -> None:
    d = _release_dir(tmp_path, {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"]})
    with pytest.raises(CheckpointError, match="inference/config.json"):
        load_config(d)
    (d / "inference").mkdir()
    shutil.copy(OFFICIAL_CONFIG, d / "inference" / "config.json")
    assert load_config(d).n_layers == 40


def test_our_own_config_still_loads(net: CEDNetwork, tmp_path: Path) -> None:
    save_checkpoint(net, tmp_path / "ours")
    assert load_config(tmp_path / "ours") == net.cfg


@torch.no_grad()
def test_each_role_reads_only_its_own_tensors_and_never_the_extras(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_config()
    path = write_synthetic_release(cfg, tmp_path / "release", seed=3)
    full = load_checkpoint(path)
    reads = TensorReads(monkeypatch)
    for role in ("encoder", "decoder"):
        reads.names.clear()
        component = load_checkpoint(path, role=role)
        own = set(role_tensor_names(cfg, role))
        weights = {n for n in reads.names if not n.endswith(".scale")}
        assert weights == own, role
        assert not any(n.startswith(("mtp.", "layers.1.engram")) for n in reads.names)
        for name, value in component.state_dict().items():
            assert torch.equal(value, full.state_dict()[name]), name
        reads.names.clear()  # the bounded build's loader: the same tensors, kept as stored
        _, stored = load_stored_role(path, role)
        assert {n for n in reads.names if not n.endswith(".scale")} == own, role
        assert stored_bytes(stored) == CheckpointFiles(path).bytes_of(own)
    enc, dec = set(role_tensor_names(cfg, "encoder")), set(role_tensor_names(cfg, "decoder"))
    assert not enc & dec and enc | dec == set(role_tensor_names(cfg, "network"))


def test_the_index_must_agree_with_the_shards(tmp_path: Path) -> None:
    path = write_synthetic_release(tiny_config(), tmp_path / "release", seed=1)
    index = json.loads((path / INDEX_FILE).read_text())
    moved = dict(index["weight_map"])
    name = "layers.3.attn.wq_a.weight"
    other = next(f for f in set(moved.values()) if f != moved[name])
    moved[name] = other
    (path / INDEX_FILE).write_text(json.dumps({"weight_map": moved}))
    with pytest.raises(CheckpointError, match=f"maps '{name}' to {other}, but that shard does not hold it"):
        CheckpointFiles(path)
    dropped = {k: v for k, v in index["weight_map"].items() if k != name}
    (path / INDEX_FILE).write_text(json.dumps({"weight_map": dropped}))
    with pytest.raises(CheckpointError, match="not in model.safetensors.index.json"):
        CheckpointFiles(path)


def test_missing_and_unknown_tensors_are_refused_before_anything_is_read(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    net = tiny_network()
    path = save_checkpoint(net, tmp_path / "ours")
    save_file({"layers.2.attn.mystery.weight": torch.zeros(2, 2)}, str(path / "extra.safetensors"))
    reads = TensorReads(monkeypatch)
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['layers.2.attn.mystery.weight'\]"):
        load_checkpoint(path)
    assert reads.names == []


@torch.no_grad()
def test_a_bf16_load_runs(tmp_path: Path) -> None:
    cfg = tiny_config()
    path = write_synthetic_release(cfg, tmp_path / "release", seed=2)
    net = load_checkpoint(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in net.parameters())
    tokens = torch.randint(0, cfg.vocab_size, (1, 40))
    logits = net(tokens).logits.float()
    reference = load_checkpoint(path)(tokens).logits
    assert torch.isfinite(logits).all() and logits.shape == reference.shape
    cosine = torch.nn.functional.cosine_similarity(logits.flatten(), reference.flatten(), dim=0)
    assert cosine > 0.99, f"bf16 logits drift from fp32: cosine {float(cosine):.4f}"


@pytest.fixture(scope="module")
def release_shaped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from build_engines.formats.release_writer import ReleaseShape, write_release_shaped

    return write_release_shaped(tmp_path_factory.mktemp("release-shaped"), ReleaseShape(dim=64, experts=8, inter=32,
                                                                                        engram_vocab=200, shards=3),
                                force=True)


def test_the_release_shaped_checkpoint_has_the_release_layout(release_shaped: Path) -> None:
    from ced.formats.release_config import is_release_config

    written = json.loads((release_shaped / "config.json").read_text())
    assert is_release_config(written) and set(written) <= set(_official()) | {"gate_temp", "norm_topk_prob"}
    cfg, extras = load_config_and_extras(release_shaped)
    assert cfg.n_layers == 40 and cfg.engram_layers == (1, 14) and cfg.runtime_fake_quant and extras is not None
    files = CheckpointFiles(release_shaped)
    table = files.tensors["layers.14.engram.embed.weight"]
    assert table.dtype == "F8_E4M3" and table.shape == (cfg.engram_num_embeddings[1], cfg.engram_head_dim)
    assert files.tensors["layers.14.engram.embed.scale"].shape == (cfg.engram_num_embeddings[1],
                                                                   cfg.engram_head_dim // 32)
    assert files.tensors["layers.1.engram.wkv.weight"].dtype == "F8_E4M3"
    assert files.tensors["layers.30.ffn.experts.7.w1.weight"].dtype == "I8"
    mtp = {n for n in files.names() if n.startswith("mtp.")}
    assert {"mtp.0.main_proj.weight", "mtp.2.markov_head.embed.weight", "mtp.2.confidence_head.proj.weight",
            "mtp.1.attn.wq_a.weight", "mtp.1.ffn.experts.7.w2.weight"} <= mtp
    assert not any(n.startswith("mtp.") and ".compressor." in n for n in mtp)  # DSpark blocks are sliding-window only
    network = set(role_tensor_names(cfg, "network"))
    assert set(files.names()) - network - mtp == {n for n in files.names() if n.endswith(".scale") and n not in mtp}
    weight_map = json.loads((release_shaped / INDEX_FILE).read_text())["weight_map"]
    assert set(weight_map) == set(files.names()) and len(set(weight_map.values())) == 3


@torch.no_grad()
def test_the_release_shaped_checkpoint_loads_by_role_and_runs(release_shaped: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    reads = TensorReads(monkeypatch)
    net = load_checkpoint(release_shaped)
    assert not any(n.startswith("mtp.") for n in reads.names)
    cfg = net.cfg
    from ced.model.engram import engram_token_map

    assert torch.equal(net.engram_token_map, engram_token_map(cfg, release_shaped / "tokenizer.json"))
    tokens = torch.randint(0, cfg.vocab_size, (1, 30))
    logits = net(tokens).logits
    assert torch.isfinite(logits).all()
    encoder, decoder = load_checkpoint(release_shaped, role="encoder"), load_checkpoint(release_shaped, role="decoder")
    handover, _ = encoder(tokens, encoder.new_state())
    assert torch.equal(decoder(handover, decoder.new_state()).logits, logits)


@torch.no_grad()
def test_the_engine_steps_run_engram_from_rows_mapped_on_the_host(release_shaped: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoder step of the release-shaped checkpoint (fp8 runtime fake-quant on) takes Engram rows gathered from
    the memory-mapped fp8 tables: each row equals the loaded parameter's row bit for bit, no table is read through
    the loader, and two prefill chunks through the step follow the reference encoder."""
    from ced.steps.encoder_step import EncoderStep
    from ced.steps.engram_feed import EngramFeed, table_name
    from ced.steps.layout import StepLayout
    from ced.steps.parity import torch_runner
    from ced.steps.rows import EncoderRow, absorb_encoder, encoder_inputs

    encoder = load_checkpoint(release_shaped, role="encoder")
    cfg = encoder.cfg
    layout = StepLayout(cfg)
    reads = TensorReads(monkeypatch)
    feed = EngramFeed.open(release_shaped, layout)
    assert feed is not None and not reads.names, "the feed maps the tables; it reads nothing through the loader"
    assert torch.equal(feed.hasher.token_map, encoder.engram_token_map)
    ids = torch.randint(0, min(cfg.engram_num_embeddings), (5, 7)).numpy()
    for layer in cfg.engram_layers:
        want = encoder.layers[str(layer)].engram.embed.weight[torch.from_numpy(ids)].numpy()
        assert feed.tables[layer].rows(ids).tobytes() == want.tobytes(), table_name(layer)
    per_token = feed.bytes_per_token()
    assert per_token == {"read": 2 * layout.engram_cols * (cfg.engram_head_dim + cfg.engram_head_dim // 32),
                         "fed": 2 * layout.engram_cols * cfg.engram_head_dim * 4}
    step = torch_runner(EncoderStep(encoder).eval(), layout.encoder_inputs(), layout.encoder_outputs())
    row, state = EncoderRow.empty(layout), encoder.new_state()
    tokens = torch.randint(0, cfg.vocab_size, (1, 45))
    for chunk in (tokens[:, :30], tokens[:, 30:]):
        out = step(encoder_inputs(layout, [row], chunk.numpy(), engram=feed))
        absorb_encoder(layout, [row], out, chunk.shape[1], chunk.numpy())
        want, state = encoder(chunk, state)
        assert (np.array_equal(out["topk"], want.topk.numpy())
                and np.array_equal(out["candidates"], want.candidates.numpy()))
        worst = float(np.abs(out["streams"] - want.streams.numpy()).max())
        assert worst < 1e-3 * max(1.0, float(want.streams.abs().max())), worst
    assert torch.equal(feed.hasher.compress(torch.from_numpy(row.engram_recent)), state.engram_history[0])


def test_encoder_steps_without_the_engram_feed_are_refused(release_shaped: Path) -> None:
    from ced.steps.layout import StepLayout
    from ced.steps.rows import EncoderRow, absorb_encoder, encoder_inputs

    layout = StepLayout(load_config(release_shaped))
    row = EncoderRow.empty(layout)
    with pytest.raises(ValueError,
                       match=r"Engram at layers \[1, 14\]: its encoder steps need the checkpoint's Engram feed"):
        encoder_inputs(layout, [row], np.zeros((1, 3), np.int64))
    with pytest.raises(ValueError, match="needs the step's tokens"):
        absorb_encoder(layout, [row], {}, 3)
