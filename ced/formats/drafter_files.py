"""Where a model directory keeps its DSpark drafter, and how it is written and read back.

Two places can hold a drafter:

* a sidecar `drafter/` folder (`drafter/config.json` with the release's DSpark keys, `drafter/model.safetensors` with
  the `mtp.*` tensors). Small presets are trained without a drafter and get one afterwards by self-distillation
  (`build_engines.training.drafter_stage`); a sidecar adds it without rewriting the backbone's checkpoint or config,
  so the backbone's hashes and every engine built from it stay valid.
* the checkpoint itself, as in the release: its config carries `n_mtp_layers`/`dspark_*` and the shards hold `mtp.*`
  (read by `load_dspark` below).

The sidecar wins when both exist, because it is the one a build wrote on purpose for this backbone.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ced.formats.checkpoint import (
    SCALE_SUFFIX,
    WEIGHTS_FILE,
    CheckpointFiles,
    check_tensors,
    fill_from_files,
    is_orphan_scale,
)
from ced.formats.config_file import CONFIG_FILE, CheckpointError, load_config, load_config_and_extras
from ced.model.config import CEDConfig, ConfigError
from ced.model.dspark import DSpark, DSparkSpec

DRAFTER_DIR = "drafter"


def save_drafter(drafter: DSpark, model_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `model_dir/drafter/` (config + weights in `dtype`) and return that folder.

    The weights are cast and made contiguous first: safetensors stores raw storage, and a view (a transposed or
    sliced parameter) would otherwise be refused or stored with the wrong layout."""
    folder = Path(model_dir) / DRAFTER_DIR
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in drafter.state_dict().items()}
    save_file(tensors, str(folder / WEIGHTS_FILE))
    (folder / WEIGHTS_FILE).chmod(0o644)  # safetensors writes 0600; a server running as another user must read it
    (folder / CONFIG_FILE).write_text(json.dumps(drafter.spec.to_release(), indent=2) + "\n")
    return folder


def _sidecar_spec(model_dir: Path, cfg: CEDConfig) -> DSparkSpec | None:
    path = model_dir / DRAFTER_DIR / CONFIG_FILE
    if not path.exists():
        return None
    try:
        keys = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    try:
        return DSparkSpec.from_release(cfg, keys)
    except ConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc


def _release_spec(model_dir: Path) -> DSparkSpec | None:
    """The checkpoint's own drafter: its config describes one *and* its shards hold `mtp.*` tensors. A config with
    DSpark keys over shards without any `mtp.*` (a trimmed or backbone-only copy) has no drafter to run."""
    try:
        _, spec = dspark_spec_of(model_dir)
    except CheckpointError:
        return None
    try:
        names = CheckpointFiles(model_dir).names()
    except CheckpointError:
        return None
    return spec if any(n.startswith("mtp.") for n in names) else None


def drafter_spec(model_dir: str | Path) -> DSparkSpec | None:
    """The spec of the drafter `model_dir` ships (sidecar first, then the release's own), or None without one."""
    model_dir = Path(model_dir)
    spec = _sidecar_spec(model_dir, load_config(model_dir))
    return spec if spec is not None else _release_spec(model_dir)


def _load_sidecar(model_dir: Path, cfg: CEDConfig, spec: DSparkSpec, dtype: torch.dtype) -> DSpark:
    path = model_dir / DRAFTER_DIR / WEIGHTS_FILE
    if not path.exists():
        raise CheckpointError(f"{path} is missing (its {CONFIG_FILE} describes a drafter)")
    stored = load_file(str(path))
    with torch.device("meta"):
        drafter = DSpark(cfg, spec)
    try:  # every missing, unknown, misshaped or non-finite tensor named at once, so a broken sidecar is fixed in one go
        check_tensors(drafter, stored)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    drafter = drafter.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for name, target in drafter.state_dict().items():
            target.copy_(stored[name].to(dtype))
    return drafter.eval()


def load_drafter(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> DSpark | None:
    """The drafter `model_dir` ships, in eval mode and `dtype`; None when it has none. A sidecar whose tensors do not
    match its spec exactly is a `CheckpointError` naming them (never a partly random drafter)."""
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    spec = _sidecar_spec(model_dir, cfg)
    if spec is not None:
        return _load_sidecar(model_dir, cfg, spec, dtype)
    if _release_spec(model_dir) is not None:
        return load_dspark(model_dir, dtype=dtype)
    return None


def dspark_spec_of(directory: str | Path) -> tuple[CEDConfig, DSparkSpec]:
    """The backbone config and the drafter a checkpoint directory's config describes; CheckpointError without one."""
    cfg, extras = load_config_and_extras(directory)
    if extras is None or not extras.n_mtp_layers or not extras.not_run.get("dspark_block_size"):
        raise CheckpointError(f"{directory}: its config describes no DSpark drafter (n_mtp_layers, dspark_block_size)")
    return cfg, DSparkSpec.from_release(cfg, extras.not_run)


def load_dspark(directory: str | Path, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> DSpark:
    """The drafter from a release directory: every `mtp.*` tensor checked by name first (none missing, none unknown),
    then read one at a time and dequantized into its parameter. Reads nothing outside `mtp.*` (the embedding and head
    are the target's: load them with `load_checkpoint`)."""
    cfg, spec = dspark_spec_of(directory)
    files = CheckpointFiles(directory)
    with torch.device("meta"):
        drafter = DSpark(cfg, spec)
    expected = set(drafter.state_dict())
    present = {n for n in files.names() if n.startswith("mtp.")}
    problems = []
    missing = sorted(expected - present)
    unexpected = sorted(n for n in present - expected
                        if not (n.endswith(SCALE_SUFFIX) and not is_orphan_scale(n, present)))
    if missing:
        problems.append(f"missing DSpark tensors {missing[:10]}{' ...' if len(missing) > 10 else ''} "
                        f"({len(missing)} in all)")
    if unexpected:
        problems.append(f"unexpected mtp.* tensors {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''} "
                        f"({len(unexpected)} in all)")
    if problems:
        raise CheckpointError("; ".join(problems))
    drafter = fill_from_files(drafter.to_empty(device=device).to(dtype), files, dtype)
    return drafter.eval()


#: The drafter tensors a decoder rank reads for `draft_main`: stage 0's projection of the target layers' means.
PROJECTION_TENSORS = ("mtp.0.main_proj.weight", "mtp.0.main_norm.weight")


def load_drafter_projection(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> DSpark | None:
    """The drafter `model_dir` ships with only stage 0's `main_proj` and `main_norm` read (the rest of it stays on the
    meta device, holding no memory); None without a drafter.

    Why: a tensor-parallel decoder rank computes each position's `draft_main` row (`ced.steps.draft_step.DraftMain`)
    and needs nothing else of the drafter; the release's drafter blocks are whole MoE layers, which every rank would
    otherwise read and hold for nothing. The drafter graph itself runs on the leader, with the whole drafter."""
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    sidecar = _sidecar_spec(model_dir, cfg)
    spec = sidecar if sidecar is not None else _release_spec(model_dir)
    if spec is None:
        return None
    with torch.device("meta"):
        drafter = DSpark(cfg, spec)
    if sidecar is not None:
        path = model_dir / DRAFTER_DIR / WEIGHTS_FILE
        if not path.exists():
            raise CheckpointError(f"{path} is missing (its {CONFIG_FILE} describes a drafter)")
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            absent = [n for n in PROJECTION_TENSORS if n not in f.keys()]
            if absent:
                raise CheckpointError(f"{path}: missing DSpark tensors {absent}")
            stored = {name: f.get_tensor(name).to(dtype) for name in PROJECTION_TENSORS}
    else:
        files = CheckpointFiles(model_dir)
        absent = [n for n in PROJECTION_TENSORS if n not in files]
        if absent:
            raise CheckpointError(f"{model_dir}: missing DSpark tensors {absent}")
        stored = {name: files.read_float(name, dtype) for name in PROJECTION_TENSORS}
    first = drafter.mtp[0]
    for module, name in ((first.main_proj, PROJECTION_TENSORS[0]), (first.main_norm, PROJECTION_TENSORS[1])):
        module.to_empty(device="cpu").to(dtype)
        if tuple(module.weight.shape) != tuple(stored[name].shape):
            raise CheckpointError(f"{model_dir}: {name} is {tuple(stored[name].shape)}, the drafter's config needs "
                                  f"{tuple(module.weight.shape)}")
        with torch.no_grad():
            module.weight.copy_(stored[name])
    return drafter.eval()
