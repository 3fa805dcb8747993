"""Checkpoint I/O: our format round trip, the released fp8/fp4 format, published names, clear errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ced.formats.checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_raw_tensors,
    save_checkpoint,
    write_synthetic_release,
)
from ced.formats.release_format import Storage, published_flash_tensors, storage_of
from ced.model.config import get_preset
from ced.model.network import CEDNetwork
from ced.model.quant_formats import dequantize_fp4_packed, dequantize_fp8_blocks
from ced.plan import main as plan_main
from ced.plan import plan
from tests.tiny import tiny_config


@torch.no_grad()
def test_round_trip_is_bit_exact(net: CEDNetwork, tmp_path: Path) -> None:
    save_checkpoint(net, tmp_path / "ckpt")
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded.cfg == net.cfg
    for name, tensor in net.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    tokens = torch.randint(0, net.cfg.vocab_size, (1, 140))
    assert torch.equal(net(tokens).logits, loaded(tokens).logits)


@torch.no_grad()
def test_synthetic_release_checkpoint_loads_dequantized_and_runs(seed: int, tmp_path: Path) -> None:
    cfg = tiny_config()
    path = write_synthetic_release(cfg, tmp_path / "release", seed=seed)
    raw = read_raw_tensors(path)
    assert len(list(path.glob("*.safetensors"))) == 2
    assert raw["layers.5.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert raw["layers.5.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert raw["layers.5.attn.wq_a.scale"].shape == (math.ceil(cfg.q_lora_rank / 32), math.ceil(cfg.dim / 32))
    assert raw["layers.5.ffn.experts.1.w2.weight"].dtype == torch.int8
    assert raw["layers.5.ffn.experts.1.w2.weight"].shape == (cfg.dim, cfg.moe_inter_dim // 2)
    assert raw["layers.5.hc_ffn_fn"].dtype == torch.float32 and raw["embed.weight"].dtype == torch.bfloat16
    net = load_checkpoint(path)
    sd = net.state_dict()
    torch.testing.assert_close(sd["layers.5.attn.wq_a.weight"],
                               dequantize_fp8_blocks(raw["layers.5.attn.wq_a.weight"], raw["layers.5.attn.wq_a.scale"]),
                               rtol=0, atol=0)
    torch.testing.assert_close(sd["layers.5.ffn.experts.1.w2.weight"],
                               dequantize_fp4_packed(raw["layers.5.ffn.experts.1.w2.weight"],
                                                     raw["layers.5.ffn.experts.1.w2.scale"]), rtol=0, atol=0)
    assert torch.equal(sd["embed.weight"], raw["embed.weight"].float())
    logits = net(torch.randint(0, cfg.vocab_size, (1, 160))).logits
    assert logits.shape == (1, 160, cfg.vocab_size) and torch.isfinite(logits).all()


def test_flash_preset_matches_the_published_tensor_list() -> None:
    with torch.device("meta"):
        net = CEDNetwork(get_preset("deepseek-v4.1-flash"))
    ours = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    published = published_flash_tensors()
    assert sorted(set(published) - set(ours)) == []
    assert sorted(set(ours) - set(published)) == []
    wrong = {k: (ours[k], published[k]) for k in published if ours[k] != published[k]}
    assert wrong == {}
    assert len(ours) == len(published) == 40 * 384 * 3 + 3 + 40 * 22 + 4 * 2 + 3 + 8 * 2 + 4 * 2
    # storage formats as released: routed experts fp4, attention projections fp8
    assert storage_of("layers.7.ffn.experts.383.w2.weight") is Storage.FP4_PACKED
    assert storage_of("layers.36.attn.indexer.wq_b.weight") is Storage.FP8_BLOCKS
    assert storage_of("layers.36.attn.indexer.weights_proj.weight") is Storage.BF16


def test_memory_plan_reproduces_published_figures(capsys: pytest.CaptureFixture[str]) -> None:
    p = plan(get_preset("deepseek-v4.1-flash"))
    assert p.global_kv_bytes_per_token == 890.0
    assert p.global_kv_main_bytes_per_token == 720.0 and p.global_kv_index_bytes_per_token == 170.0
    assert abs(p.params_total / 552e9 - 1) < 0.01
    plan_main(["--preset", "mol2-small"])
    out = capsys.readouterr().out
    assert "memory plan for preset 'mol2-small'" in out and "global KV bytes per token" in out
    with pytest.raises(SystemExit):
        plan_main(["--preset", "no-such-preset"])
    assert "unknown preset 'no-such-preset'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- bad input
def _corrupt(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("layers.6.attn.indexer.weights_proj.weight"),
         r"missing tensors \['layers.6.attn.indexer.weights_proj.weight'\]"),
        (lambda t: t.update({"layers.6.attn.wq_b.weight": torch.zeros(3, 3)}),
         r"tensor 'layers.6.attn.wq_b.weight' has shape \(3, 3\), expected \(256, 32\)"),
        (lambda t: t.update({"layers.1.attn.attn_sink": torch.zeros(4, dtype=torch.int32)}),
         r"tensor 'layers.1.attn.attn_sink' has unsupported dtype torch.int32"),
        (lambda t: t.update({"layers.3.ffn.gate.bias": torch.full((4,), float("nan"))}),
         r"tensor 'layers.3.ffn.gate.bias' holds NaN"),
        (lambda t: t.update({"layers.3.attn.bogus": torch.zeros(2)}), r"unexpected tensors \['layers.3.attn.bogus'\]"),
        (lambda t: t.update({"layers.3.attn.wkv.weight": torch.zeros(64, 64).to(torch.float8_e4m3fn)}),
         r"fp8 tensor 'layers.3.attn.wkv.weight' has no scale tensor 'layers.3.attn.wkv.scale'"),
        (
            lambda t: t.update({"layers.3.attn.wkv.weight": torch.zeros(64, 64).to(torch.float8_e4m3fn),
                                "layers.3.attn.wkv.scale": torch.ones(3, 3).to(torch.float8_e8m0fnu)}),
            r"tensor 'layers.3.attn.wkv.weight': ",
        ),
    ],
)
def test_bad_checkpoints_name_the_tensor(net: CEDNetwork, tmp_path: Path, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    save_checkpoint(net, tmp_path)
    _corrupt(tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path)


def test_missing_config_and_weights(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_checkpoint(tmp_path)
    tiny_config().save(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=r"no \*.safetensors file"):
        load_checkpoint(tmp_path)


def test_tensors_are_read_as_stored_into_memory_of_their_own(tmp_path: Path) -> None:
    """`CheckpointFiles.get` reads each tensor's byte range (no shard mapping): every dtype the release stores comes
    back equal to safetensors' own reading, owns its memory, and a shard cut short is named, not read past."""
    from ced.formats.checkpoint import CheckpointFiles

    tensors = {
        "f32": torch.randn(3, 5), "bf16": torch.randn(4, 2).bfloat16(), "scalar": torch.tensor(2.5),
        "fp8": torch.randn(8, 4).to(torch.float8_e4m3fn), "e8m0": torch.rand(2, 2).add(0.5).to(torch.float8_e8m0fnu),
        "i8": torch.randint(-8, 8, (6,), dtype=torch.int8), "empty": torch.zeros(0, 3),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    files = CheckpointFiles(tmp_path)

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8)

    for name, want in load_file(str(tmp_path / "model.safetensors")).items():
        got = files.get(name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(raw(got), raw(want)), name
        assert got.untyped_storage().nbytes() == want.numel() * want.element_size(), name  # not a view of the shard
        raw(got).fill_(0)  # its own buffer: writing it changes neither the file nor a second read
        assert torch.equal(raw(files.get(name)), raw(want)), name
    shard = tmp_path / "model.safetensors"
    last = max(files.tensors.values(), key=lambda t: t.offset)
    shard.write_bytes(shard.read_bytes()[: last.offset + last.nbytes - 1])
    with pytest.raises(CheckpointError, match=rf"{last.name}: model.safetensors ends 1 bytes before the tensor does"):
        CheckpointFiles(tmp_path).get(last.name)
