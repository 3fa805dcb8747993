"""Checkpoint I/O in the released naming: our own safetensors checkpoints and the real (fp8/fp4) format.

Both kinds are directories holding `config.json` (our `CEDConfig`) and one or more `*.safetensors` files whose
tensor names are the release's (`embed.weight`, `layers.N.attn.wq_a.weight`, ...). Ours store plain floats; the
release stores fp8 e4m3 weights with `<name>.scale` ue8m0 block scales and routed experts as packed fp4. One loader
reads both: every tensor is dequantized by what its dtype and scale say, then checked against the network.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from build_engines.formats.config_file import CONFIG_FILE, CheckpointError, load_config
from build_engines.formats.quant_formats import (
    dequantize_fp4_packed,
    dequantize_fp8_blocks,
    quantize_fp4_packed,
    quantize_fp8_blocks,
)
from build_engines.formats.release_format import Storage, is_optional_extra, storage_of
from build_engines.model.config import CEDConfig
from build_engines.model.network import CEDNetwork, init_weights

WEIGHTS_FILE = "model.safetensors"
SCALE_SUFFIX = ".scale"


def save_checkpoint(net: CEDNetwork, directory: str | Path) -> Path:
    """Write config.json + model.safetensors (contiguous fp32/bf16 tensors under the released names)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    net.cfg.save(directory / CONFIG_FILE)
    tensors = {k: v.detach().contiguous().cpu() for k, v in net.state_dict().items()}
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt", "preset": net.cfg.name})
    return directory


def _weight_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors file in {directory}")
    return files


def read_raw_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of all shards, as stored (no dequantization); duplicate names across shards are an error."""
    out: dict[str, torch.Tensor] = {}
    for path in _weight_files(Path(directory)):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name in out:
                    raise CheckpointError(f"tensor {name!r} appears in more than one shard (second: {path.name})")
                out[name] = f.get_tensor(name)
    return out


def dequantize_tensors(raw: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Turn stored tensors into plain floats: fp8 blocks and packed fp4 use their `.scale`; extras are skipped.

    Returns (tensors by parameter name, skipped optional-extra names).
    """
    out: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for name, tensor in raw.items():
        if name.endswith(SCALE_SUFFIX):
            if name[: -len(SCALE_SUFFIX)] not in raw and name[: -len(SCALE_SUFFIX)] + ".weight" not in raw:
                raise CheckpointError(f"scale tensor {name!r} has no weight beside it")
            continue
        if is_optional_extra(name):
            skipped.append(name)
            continue
        scale_name = name[: -len(".weight")] + SCALE_SUFFIX if name.endswith(".weight") else name + SCALE_SUFFIX
        scale = raw.get(scale_name)
        try:
            if tensor.dtype == torch.float8_e4m3fn:
                if scale is None:
                    raise CheckpointError(f"fp8 tensor {name!r} has no scale tensor {scale_name!r}")
                out[name] = dequantize_fp8_blocks(tensor, scale, out_dtype=dtype)
            elif tensor.dtype in (torch.int8, torch.uint8):
                if scale is None:
                    raise CheckpointError(f"packed fp4 tensor {name!r} has no scale tensor {scale_name!r}")
                out[name] = dequantize_fp4_packed(tensor, scale, out_dtype=dtype)
            elif tensor.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
                if scale is not None:
                    raise CheckpointError(f"tensor {name!r} is {tensor.dtype} but has a scale {scale_name!r}")
                out[name] = tensor.to(dtype)
            else:
                raise CheckpointError(f"tensor {name!r} has unsupported dtype {tensor.dtype}")
        except CheckpointError:
            raise
        except ValueError as exc:  # shape/scale problems from the quant formats, prefixed with the tensor name
            raise CheckpointError(f"tensor {name!r}: {exc}") from exc
    return out, skipped


def check_tensors(net: CEDNetwork, tensors: dict[str, torch.Tensor]) -> None:
    """Every network parameter present with its shape, nothing unknown, nothing non-finite; one error lists all."""
    expected = net.state_dict()
    problems: list[str] = []
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        problems.append(f"missing tensors {missing[:10]}{' ...' if len(missing) > 10 else ''} ({len(missing)} in all)")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''} ({len(unexpected)} in all)")
    for name in sorted(set(expected) & set(tensors)):
        want, got = tuple(expected[name].shape), tuple(tensors[name].shape)
        if want != got:
            problems.append(f"tensor {name!r} has shape {got}, expected {want}")
        elif not tensors[name].is_floating_point():
            problems.append(f"tensor {name!r} has dtype {tensors[name].dtype}, expected a float")
        elif not bool(torch.isfinite(tensors[name]).all()):
            problems.append(f"tensor {name!r} holds NaN or Inf")
    if problems:
        raise CheckpointError("; ".join(problems))


def load_checkpoint(directory: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> CEDNetwork:
    """Load ours or the released format (detected per tensor by dtype); the network is returned in eval mode."""
    cfg = load_config(directory)
    tensors, _ = dequantize_tensors(read_raw_tensors(directory), dtype)
    with torch.device("meta"):
        net = CEDNetwork(cfg)
    check_tensors(net, tensors)
    net = net.to_empty(device=device)
    net.load_state_dict({k: v.to(device) for k, v in tensors.items()}, strict=True)
    return net.to(dtype).eval()


def write_synthetic_release(cfg: CEDConfig, directory: str | Path, seed: int = 0, shards: int = 2, extras: bool = True) -> Path:
    """A random checkpoint in the release's naming and storage dtypes (for tests at reduced width).

    fp8 weights get 32x32 ue8m0 block scales, routed experts are packed fp4 with one ue8m0 scale per 32,
    hc/sink/gate biases stay f32 and the rest bf16, split over `shards` files; `extras` adds a few Engram/DSpark
    tensors that the loader must skip.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    net = CEDNetwork(cfg)
    init_weights(net)
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in net.state_dict().items():
        t = tensor.detach().float()
        storage = storage_of(name)
        if storage is Storage.FP8_BLOCKS:
            stored[name], stored[name[: -len(".weight")] + SCALE_SUFFIX] = quantize_fp8_blocks(t)
        elif storage is Storage.FP4_PACKED:
            stored[name], stored[name[: -len(".weight")] + SCALE_SUFFIX] = quantize_fp4_packed(t)
        elif storage is Storage.F32:
            stored[name] = t.contiguous()
        else:
            stored[name] = t.to(torch.bfloat16).contiguous()
    if extras:
        stored["mtp.0.norm.weight"] = torch.ones(cfg.dim, dtype=torch.bfloat16)
        stored["layers.1.engram.q_weight"] = torch.zeros(cfg.hc_mult, cfg.dim, dtype=torch.bfloat16)
    names = sorted(stored)
    per_shard = -(-len(names) // shards)
    index: dict[str, str] = {}
    for s in range(shards):
        part = names[s * per_shard : (s + 1) * per_shard]
        if not part:
            continue
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: stored[k] for k in part}, str(directory / fname))
        index.update({k: fname for k in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}, indent=1))
    cfg.save(directory / CONFIG_FILE)
    return directory
