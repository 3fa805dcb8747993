"""The drafter sidecar (`drafter/` beside a backbone checkpoint): a bf16 round trip is exact, a damaged file is
refused by tensor name, and a model without a drafter says so with None rather than a random drafter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from ced.formats.checkpoint import save_checkpoint
from ced.formats.config_file import CheckpointError
from ced.formats.drafter_files import (
    DRAFTER_DIR,
    PROJECTION_TENSORS,
    WEIGHTS_FILE,
    drafter_spec,
    dspark_spec_of,
    load_drafter,
    load_drafter_projection,
    save_drafter,
)
from ced.model.dspark import DSpark, DSparkSpec
from ced.model.network import init_weights
from tests.tiny import tiny_config, tiny_network


def _model_dir(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    return save_checkpoint(tiny_network().to(torch.bfloat16), tmp_path / "model")


def _drafter(seed: int = 3) -> DSpark:
    cfg = tiny_config()
    torch.manual_seed(seed)
    drafter = DSpark(cfg, DSparkSpec.scaled(cfg))
    init_weights(drafter)
    return drafter.eval()


def test_a_bf16_round_trip_is_bitwise(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    drafter = _drafter()
    folder = save_drafter(drafter, model)
    assert folder == model / DRAFTER_DIR
    assert json.loads((folder / "config.json").read_text()) == drafter.spec.to_release()
    stored = load_file(str(folder / WEIGHTS_FILE))
    assert set(stored) == set(drafter.state_dict()) and all(n.startswith("mtp.") for n in stored)
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    assert drafter_spec(model) == drafter.spec
    loaded = load_drafter(model, dtype=torch.bfloat16)
    assert loaded is not None and not loaded.training
    want = {n: t.to(torch.bfloat16) for n, t in drafter.state_dict().items()}
    assert all(torch.equal(loaded.state_dict()[n], want[n]) for n in want)
    as_fp32 = load_drafter(model)
    assert as_fp32 is not None and all(torch.equal(as_fp32.state_dict()[n], want[n].float()) for n in want)


def _damage(folder: Path, change: Callable[[dict], object]) -> None:
    tensors = load_file(str(folder / WEIGHTS_FILE))
    change(tensors)
    save_file(tensors, str(folder / WEIGHTS_FILE))


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("mtp.2.confidence_head.proj.weight"),
     r"missing tensors \['mtp.2.confidence_head.proj.weight'\]"),
    (lambda t: t.update({"mtp.1.norm.weight": torch.ones(64, dtype=torch.bfloat16)}),
     r"unexpected tensors \['mtp.1.norm.weight'\]"),
    (lambda t: t.update({"mtp.0.main_proj.weight": torch.zeros(64, 64, dtype=torch.bfloat16)}),
     r"'mtp.0.main_proj.weight' has shape \(64, 64\), expected \(64, 192\)"),
])
def test_a_damaged_sidecar_is_refused_by_name(tmp_path: Path, change: Callable[[dict], object], message: str) -> None:
    model = _model_dir(tmp_path)
    _damage(save_drafter(_drafter(), model), change)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(model)


def test_a_sidecar_config_that_does_not_fit_the_backbone_is_refused(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    folder = save_drafter(_drafter(), model)
    keys = json.loads((folder / "config.json").read_text()) | {"dspark_target_layer_ids": [7, 8]}
    (folder / "config.json").write_text(json.dumps(keys))
    with pytest.raises(CheckpointError, match="dspark_target_layer_ids"):
        drafter_spec(model)


def test_a_model_without_a_drafter_has_none(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    assert drafter_spec(model) is None and load_drafter(model) is None and load_drafter_projection(model) is None
    # a stray mtp.* tensor without a config that describes a drafter is not a drafter either
    tensors = load_file(str(model / "model.safetensors"))
    tensors["mtp.0.norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    save_file(tensors, str(model / "model.safetensors"))
    assert drafter_spec(model) is None and load_drafter(model) is None


def test_a_release_directory_gives_its_own_drafter(tmp_path: Path) -> None:
    from build_engines.formats.release_writer import ReleaseShape, write_release_shaped

    shape = ReleaseShape(dim=64, experts=8, inter=32, dspark_experts=4, engram_vocab=200, shards=2)
    release = write_release_shaped(tmp_path / "release", shape, force=True)
    spec = drafter_spec(release)
    assert spec is not None and spec == dspark_spec_of(release)[1]
    drafter = load_drafter(release)
    assert drafter is not None and drafter.spec == spec and not drafter.training


def _assert_projection_alone(projection: DSpark | None, whole: DSpark | None) -> None:
    """Stage 0's main_proj / main_norm equal the whole drafter's; every other drafter tensor holds no memory."""
    assert projection is not None and whole is not None and projection.spec == whole.spec
    state, want = projection.state_dict(), whole.state_dict()
    for name, tensor in state.items():
        if name in PROJECTION_TENSORS:
            assert tensor.device.type == "cpu" and torch.equal(tensor, want[name]), name
        else:
            assert tensor.is_meta, f"{name} was read: a decoder rank needs only {PROJECTION_TENSORS}"


def test_a_decoder_rank_reads_only_the_drafter_projection_from_a_sidecar(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    folder = save_drafter(_drafter(), model)
    _assert_projection_alone(load_drafter_projection(model), load_drafter(model))
    _damage(folder, lambda t: t.pop("mtp.0.main_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing DSpark tensors \['mtp.0.main_norm.weight'\]"):
        load_drafter_projection(model)


def test_a_decoder_rank_reads_only_the_drafter_projection_from_a_release(tmp_path: Path) -> None:
    from build_engines.formats.release_writer import ReleaseShape, write_release_shaped

    shape = ReleaseShape(dim=64, experts=8, inter=32, dspark_experts=4, engram_vocab=200, shards=2)
    release = write_release_shaped(tmp_path / "release", shape, force=True)
    _assert_projection_alone(load_drafter_projection(release), load_drafter(release))
