"""Checkpoint I/O in the released naming: our own safetensors checkpoints and the real (fp8/fp4) format.

Both kinds are directories holding `config.json` (our `CEDConfig`, or the release's own keys, see `config_file`) and
one or more `*.safetensors` files (with `model.safetensors.index.json` when sharded) whose tensor names are the
release's (`embed.weight`, `layers.N.attn.wq_a.weight`, ...). Ours store plain floats; the release stores fp8 e4m3
weights with `<name>.scale` ue8m0 block scales and routed experts as packed fp4. One loader reads both, lazily: the
names are checked from the shard headers first, then only the tensors of the requested role are read, each
dequantized by what its dtype and scale say straight into its parameter.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file
from torch import nn

from ced.formats.config_file import CONFIG_FILE, CheckpointError, load_config
from ced.formats.release_format import Storage, is_optional_extra, storage_of
from ced.model.config import CEDConfig
from ced.model.network import CEDNetwork, init_weights
from ced.model.quant_formats import (
    dequantize_fp4_packed,
    dequantize_fp8_blocks,
    quantize_fp4_packed,
    quantize_fp8_blocks,
)

WEIGHTS_FILE = "model.safetensors"
SCALE_SUFFIX = ".scale"


def scale_name_of(name: str) -> str:
    """The release's name for a tensor's block scales: `<module>.scale` beside `<module>.weight`
    (else `<name>.scale`)."""
    return name[: -len(".weight")] + SCALE_SUFFIX if name.endswith(".weight") else name + SCALE_SUFFIX


def is_orphan_scale(name: str, present: set[str] | dict) -> bool:  # type: ignore[type-arg]
    """A `.scale` tensor with no weight beside it (neither `<module>` nor `<module>.weight`)."""
    owner = name[: -len(SCALE_SUFFIX)]
    return name.endswith(SCALE_SUFFIX) and owner not in present and owner + ".weight" not in present


def save_checkpoint(net: CEDNetwork, directory: str | Path) -> Path:
    """Write config.json + model.safetensors (contiguous fp32/bf16 tensors under the released names)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    net.cfg.save(directory / CONFIG_FILE)
    tensors = {k: v.detach().contiguous().cpu() for k, v in net.state_dict().items()}
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt", "preset": net.cfg.name})
    return directory


INDEX_FILE = "model.safetensors.index.json"
HEADER_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1,
                      "I32": 4, "I64": 8}
HEADER_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8,
                       "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a shard's header describes it: where it is and how many bytes it holds (nothing read yet)."""

    name: str
    shard: Path
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0  # of its first byte in the shard file (after the header)


def _read_header(path: Path) -> dict[str, StoredTensor]:
    """A safetensors header (8-byte length + JSON): names, dtypes, shapes, byte ranges, without touching the data."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size <= 0 or size > 100_000_000:
            raise CheckpointError(f"{path.name} is not a safetensors file (header length {size})")
        try:
            header = json.loads(f.read(size))
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path.name} has an unreadable safetensors header: {exc}") from exc
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[name] = StoredTensor(name, path, info["dtype"], tuple(info["shape"]), end - begin, 8 + size + begin)
    return out


class CheckpointFiles:
    """The tensors of a checkpoint directory by name, read one at a time, each with one read of its byte range.

    Why lazy: the release is ~1.5 TB across 48 shards (Engram tables ~200 GB of it); a role reads only the tensors it
    needs, and a tensor no role runs (DSpark `mtp.*` until its drafter runs, vision) is never read at all. The shard
    of each tensor comes from `model.safetensors.index.json` when present (checked against the shards' headers),
    else from the headers of every `*.safetensors` file.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        shards = sorted(self.directory.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"no *.safetensors file in {self.directory}")
        self.tensors: dict[str, StoredTensor] = {}
        for shard in shards:
            for name, stored in _read_header(shard).items():
                if name in self.tensors:
                    raise CheckpointError(f"tensor {name!r} appears in more than one shard (second: {shard.name})")
                self.tensors[name] = stored
        self._check_index()

    def _check_index(self) -> None:
        index = self.directory / INDEX_FILE
        if not index.exists():
            return
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} has no readable weight_map: {exc}") from exc
        problems = []
        for name, shard in weight_map.items():
            stored = self.tensors.get(name)
            if not (self.directory / shard).exists():
                problems.append(f"{INDEX_FILE} maps {name!r} to {shard}, which is missing")
            elif stored is None or stored.shard.name != shard:
                problems.append(f"{INDEX_FILE} maps {name!r} to {shard}, but that shard does not hold it")
        unlisted = sorted(set(self.tensors) - set(weight_map))
        if unlisted:
            problems.append(f"tensors {unlisted[:5]} are in the shards but not in {INDEX_FILE} "
                            f"({len(unlisted)} in all)")
        if problems:
            raise CheckpointError("; ".join(problems[:10])
                                  + (f" ... ({len(problems)} problems)" if len(problems) > 10 else ""))

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str) -> torch.Tensor:
        """The stored tensor (its own dtype), in memory of its own: one positioned read of its byte range.

        Why not the memory-mapped shard (`safe_open`): its tensors are views into a mapping of the whole shard, and
        every page a build touches stays resident in that mapping as long as any tensor of the shard lives, so a
        process that copies some tensors (an expert chunk, a dequantized weight) counts their bytes twice; a read
        into a fresh buffer is the one copy, and the page cache it goes through is not the process's memory."""
        stored = self.tensors[name]
        dtype = HEADER_TORCH_DTYPES.get(stored.dtype)
        if dtype is None:
            raise CheckpointError(f"{name}: stored dtype {stored.dtype} is not one we read")
        buffer = torch.empty(stored.nbytes, dtype=torch.uint8)
        with open(stored.shard, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [buffer.numpy()], stored.offset) if stored.nbytes else 0
        if got != stored.nbytes:
            raise CheckpointError(f"{name}: {stored.shard.name} ends {stored.nbytes - got} bytes "
                                  "before the tensor does")
        return buffer.view(dtype).reshape(stored.shape)

    def scale_name(self, name: str) -> str:
        return scale_name_of(name)

    def read_float(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One tensor as plain floats: read with its scale (when it has one) and dequantized, nothing else read."""
        scale = scale_name_of(name)
        return dequantize_one(name, self.get(name), self.get(scale) if scale in self.tensors else None, dtype)

    def bytes_of(self, names: Iterable[str]) -> int:
        """Stored bytes of these parameters, their scale tensors included."""
        total = 0
        for name in names:
            total += self.tensors[name].nbytes
            scale = self.tensors.get(self.scale_name(name))
            total += scale.nbytes if scale is not None else 0
        return total


def read_raw_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of all shards, as stored (no dequantization). Reads everything: for tests and small checkpoints."""
    files = CheckpointFiles(directory)
    return {name: files.get(name) for name in files.names()}


def dequantize_one(name: str, tensor: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """One stored tensor as plain floats: fp8 blocks and packed fp4 use their scale, floats are cast."""
    scale_name = scale_name_of(name)
    try:
        if tensor.dtype == torch.float8_e4m3fn:
            if scale is None:
                raise CheckpointError(f"fp8 tensor {name!r} has no scale tensor {scale_name!r}")
            return dequantize_fp8_blocks(tensor, scale, out_dtype=dtype)
        if tensor.dtype in (torch.int8, torch.uint8):
            if scale is None:
                raise CheckpointError(f"packed fp4 tensor {name!r} has no scale tensor {scale_name!r}")
            return dequantize_fp4_packed(tensor, scale, out_dtype=dtype)
        if tensor.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            if scale is not None:
                raise CheckpointError(f"tensor {name!r} is {tensor.dtype} but has a scale {scale_name!r}")
            return tensor.to(dtype)
        raise CheckpointError(f"tensor {name!r} has unsupported dtype {tensor.dtype}")
    except ValueError as exc:  # shape/scale problems from the quant formats, prefixed with the tensor name
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"tensor {name!r}: {exc}") from exc


def dequantize_tensors(raw: dict[str, torch.Tensor],
                       dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Turn stored tensors into plain floats: fp8 blocks and packed fp4 use their `.scale`; extras are skipped.

    Returns (tensors by parameter name, skipped optional-extra names).
    """
    out: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for name, tensor in raw.items():
        if name.endswith(SCALE_SUFFIX):
            if is_orphan_scale(name, raw):
                raise CheckpointError(f"scale tensor {name!r} has no weight beside it")
            continue
        if is_optional_extra(name):
            skipped.append(name)
            continue
        out[name] = dequantize_one(name, tensor, raw.get(scale_name_of(name)), dtype)
    return out, skipped


def _check_one(name: str, tensor: torch.Tensor, want: tuple[int, ...]) -> str | None:
    if tuple(tensor.shape) != want:
        return f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {want}"
    if not tensor.is_floating_point():
        return f"tensor {name!r} has dtype {tensor.dtype}, expected a float"
    if not bool(torch.isfinite(tensor).all()):
        return f"tensor {name!r} holds NaN or Inf"
    return None


def check_tensors(net: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Every network parameter present with its shape, nothing unknown, nothing non-finite; one error lists all."""
    expected = net.state_dict()
    problems: list[str] = []
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        problems.append(f"missing tensors {missing[:10]}{' ...' if len(missing) > 10 else ''} ({len(missing)} in all)")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''} "
                        f"({len(unexpected)} in all)")
    for name in sorted(set(expected) & set(tensors)):
        problem = _check_one(name, tensors[name], tuple(expected[name].shape))
        if problem:
            problems.append(problem)
    if problems:
        raise CheckpointError("; ".join(problems))


ROLES = ("network", "encoder", "decoder")


def read_role_stored(directory: str | Path, role: str) -> dict[str, torch.Tensor]:
    """A role's tensors exactly as stored (fp8 / packed fp4 with their scales, bf16, f32): what an engine builder that
    keeps the release's formats consumes, at the role's share of the checkpoint bytes and no more."""
    cfg = load_config(directory)
    files = CheckpointFiles(directory)
    _audit_names(files, cfg)
    out: dict[str, torch.Tensor] = {}
    for name in role_tensor_names(cfg, role):
        out[name] = files.get(name)
        scale = files.scale_name(name)
        if scale in files:
            out[scale] = files.get(scale)
    return out


def _role_module(cfg: CEDConfig, role: str) -> nn.Module:
    from ced.model.network import DecoderEngine, EncoderEngine

    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles: {ROLES}")
    with torch.device("meta"):
        return {"network": CEDNetwork, "encoder": EncoderEngine, "decoder": DecoderEngine}[role](cfg)


def role_tensor_names(cfg: CEDConfig, role: str) -> list[str]:
    """The released tensor names a role runs (its parameters), from the component built on the meta device."""
    return list(_role_module(cfg, role).state_dict())


def _audit_names(files: CheckpointFiles, cfg: CEDConfig) -> None:
    """Before reading anything: every parameter of the whole network present, nothing unknown, every scale paired."""
    expected = set(role_tensor_names(cfg, "network"))
    present = set(files.names())
    problems = []
    missing = sorted(expected - present)
    if missing:
        problems.append(f"missing tensors {missing[:10]}{' ...' if len(missing) > 10 else ''} ({len(missing)} in all)")
    scales = {n for n in present if n.endswith(SCALE_SUFFIX)}
    orphans = sorted(s for s in scales if is_orphan_scale(s, present))
    if orphans:
        problems.append(f"scale tensors {orphans[:5]} have no weight beside them")
    unexpected = sorted(n for n in present - expected - scales if not is_optional_extra(n))
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''} "
                        f"({len(unexpected)} in all)")
    if problems:
        raise CheckpointError("; ".join(problems))


def load_checkpoint(directory: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    role: str = "network") -> nn.Module:
    """Load ours or the released format (detected per tensor by dtype); returned in eval mode.

    `role` = "network" (the whole `CEDNetwork`), "encoder" or "decoder" (that engine component alone): only the
    role's tensors are read, one at a time, each dequantized straight into its parameter, so the peak is the role's
    parameters in `dtype` plus one tensor in flight; tensors of parts we do not run are never read.
    """
    cfg = load_config(directory)
    files = CheckpointFiles(directory)
    _audit_names(files, cfg)
    net = _role_module(cfg, role)
    net = fill_from_files(net.to_empty(device=device).to(dtype), files, dtype)
    _install_engram_token_map(net, cfg, Path(directory))
    return net.eval()


def fill_from_files(module: torch.nn.Module, files: CheckpointFiles, dtype: torch.dtype) -> torch.nn.Module:
    """Every tensor of `module`'s state read from `files` by name, one at a time, dequantized into its parameter;
    CheckpointError naming every tensor of the wrong shape or with bad values (none is copied then)."""
    problems = []
    with torch.no_grad():
        for name, target in module.state_dict().items():
            tensor = files.read_float(name, dtype)
            problem = _check_one(name, tensor, tuple(target.shape))
            if problem:
                problems.append(problem)
                continue
            target.copy_(tensor)
            del tensor
    if problems:
        raise CheckpointError("; ".join(problems))
    return module


def directory_token_map(cfg: CEDConfig, directory: Path) -> torch.Tensor | None:
    """Engram's compressed token map from the model directory's tokenizer.json (the release ships no tensor for it),
    checked against the config; None without a tokenizer.json (our own test checkpoints: the placeholder map)."""
    tokenizer = Path(directory) / "tokenizer.json"
    if not tokenizer.exists():
        return None
    from ced.model.engram import engram_token_map

    try:
        return engram_token_map(cfg, tokenizer)
    except ValueError as exc:
        raise CheckpointError(f"{tokenizer}: {exc}") from exc


def _install_engram_token_map(net: nn.Module, cfg: CEDConfig, directory: Path) -> None:
    """Engram hashes compressed token ids: install the directory's map (`directory_token_map`); without one the
    network keeps its placeholder map."""
    if not cfg.engram_layers or not hasattr(net, "set_engram_token_map"):
        return
    token_map = directory_token_map(cfg, directory)
    if token_map is not None:
        try:
            net.set_engram_token_map(token_map)
        except ValueError as exc:
            raise CheckpointError(f"{directory / 'tokenizer.json'}: {exc}") from exc


def stored_as_released(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """One parameter in the release's storage (`release_format.storage_of`): the stored tensor, and its scale under
    the release's name when it has one (fp8 32x32 blocks; Engram tables per 32 along each row; packed fp4)."""
    t = tensor.detach().float()
    storage = storage_of(name)
    if storage in (Storage.FP8_BLOCKS, Storage.FP8_ROWS):
        q, scale = quantize_fp8_blocks(t, block=(1, 32) if storage is Storage.FP8_ROWS else (32, 32))
        return {name: q, scale_name_of(name): scale}
    if storage is Storage.FP4_PACKED:
        q, scale = quantize_fp4_packed(t)
        return {name: q, scale_name_of(name): scale}
    if storage is Storage.F32:
        return {name: t.contiguous()}
    return {name: t.to(torch.bfloat16).contiguous()}


def write_synthetic_release(cfg: CEDConfig, directory: str | Path, seed: int = 0, shards: int = 2,
                            extras: bool = True) -> Path:
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
        stored.update(stored_as_released(name, tensor))
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
