"""TensorRT engines from the ONNX graphs: plugins registered, one optimization profile per step shape, plans.

Written against TensorRT's Python API (>= 10.8 for `tensorrt.plugin`): the ONNX parser maps every `mol2` node that
carries `plugin_namespace` to the registered plugin (plugins/*/trt.py, OpenAI Triton kernels compiled ahead of time),
never to the local function. Profiles: the encoder gets a prefill profile (one row, S up to the prefill chunk) and a
decode profile (up to `max_batch` rows, S = 1); the decoder a replay profile (S = W) and a decode profile; global
stores span the minimum store length up to `max_context`. Quantized builds are strongly typed (the Q/DQ nodes decide
precisions). Without TensorRT this module is never imported past `require_tensorrt_plugin`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ced.engine_dir.manifest import sha256_file
from ced.steps.layout import SPEC_BLOCK, GraphTensor, StepLayout
from ced.steps.lora_grid import MIN_GRID_ROWS
from plugins.tensorrt_support import require_tensorrt_plugin

PLAN_FILES = {"encoder": "encoder.plan", "decoder": "decoder.plan", "pointer": "pointer.plan",
              "drafter": "drafter.plan"}


@dataclass(frozen=True)
class TrtLimits:
    max_batch: int = 64
    max_context: int = 8192
    prefill_chunk: int = 256
    max_adapter_slots: int = 17  # base + 16 adapters
    max_rank: int = 64
    max_options: int = 64
    max_option_tokens: int = 64
    workspace_bytes: int = 4 << 30




def profile_ranges(layout: StepLayout, graph: str, limits: TrtLimits,
                   head_count: int = 4) -> dict[str, dict[str, tuple[int, int, int]]]:
    """Per profile name: symbolic dim -> (min, opt, max)."""
    cfg = layout.cfg
    stores = {f"N_{s}": (layout.min_global_entries, layout.padded_entries(1024 // layout.ratio[s]),
                         layout.padded_entries(limits.max_context // layout.ratio[s] + limits.prefill_chunk))
              for s in layout.sources}
    lora = {"A": (1, 5, limits.max_adapter_slots), "R": (1, 16, limits.max_rank), "U": (1, 4, limits.max_adapter_slots)}
    B = (1, 16, limits.max_batch)
    if graph == "encoder":
        return {"prefill": {"B": (1, 1, 1), "S": (1, 128, limits.prefill_chunk), **stores},
                "decode": {"B": B, "S": (1, 1, 2), **stores}}
    if graph == "decoder":
        W = cfg.window_size
        grid = MIN_GRID_ROWS  # a LoRA grid row holds one used slot's positions (ced/steps/lora_grid.py)
        # K: positions whose logits a step also returns (`verify`): none on a replay; up to a speculative block of
        # SPEC_BLOCK positions on a decode step, whose S then reaches the block too
        return {"replay": {"B": (1, 1, limits.max_batch), "S": (1, W, W), "C": (grid, W, limits.max_batch * W),
                           "K": (0, 0, 0), **stores, **lora},
                "decode": {"B": B, "S": (1, 1, SPEC_BLOCK), "C": (grid, 16, SPEC_BLOCK * limits.max_batch),
                           "K": (0, 0, SPEC_BLOCK), **stores, **lora}}
    if graph == "drafter":  # one call per drafting lane: at most `speculative_batch` rows (drafting.DRAFT_BATCH)
        return {"draft": {"B": (1, 1, min(limits.max_batch, 16))}}
    hl = head_count * limits.max_options * limits.max_option_tokens
    return {"route": {"B": B, "n": (1, 4, limits.max_options), "HL": (1, head_count * 4 * 32, hl)}}


def _shape(t: GraphTensor, ranges: dict[str, tuple[int, int, int]], which: int) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) else ranges[d][which] for d in t.dims)


def build_plan(onnx_path: Path, plan_path: Path, inputs: list[GraphTensor],
               profiles: dict[str, dict[str, tuple[int, int, int]]], strongly_typed: bool,
               limits: TrtLimits) -> dict[str, Any]:
    """Parse one ONNX graph, add its profiles, build and write the serialized engine."""
    require_tensorrt_plugin()
    import tensorrt as trt

    from plugins import register_all

    registered = register_all()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly_typed else 0
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT's ONNX parser rejected {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, limits.workspace_bytes)
    by_name = {t.name: t for t in inputs}
    for ranges in profiles.values():
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            tensor = network.get_input(i)
            spec = by_name[tensor.name]
            profile.set_shape(tensor.name, _shape(spec, ranges, 0), _shape(spec, ranges, 1), _shape(spec, ranges, 2))
        config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT could not build {onnx_path.name} (see the log above)")
    plan_path.write_bytes(bytes(serialized))
    return {"file": plan_path.name, "sha256": sha256_file(plan_path), "bytes": plan_path.stat().st_size,
            "profiles": list(profiles), "plugins": registered, "strongly_typed": strongly_typed, "from": onnx_path.name}


def build_trt(onnx_dir: Path, out: Path, layout: StepLayout, graphs: dict[str, dict[str, Any]], quant: str,
              limits: TrtLimits) -> dict[str, dict[str, Any]]:
    """Plans for every ONNX graph in `onnx_dir` (described by `graphs`), written into `out`."""
    plans = {}
    for name, graph in graphs.items():
        inputs = [GraphTensor(t["name"], t["dtype"], tuple(t["dims"])) for t in graph["inputs"]]
        profiles = profile_ranges(layout, name, limits)
        plans[name] = build_plan(onnx_dir / graph["file"], out / PLAN_FILES[name], inputs, profiles, quant != "none",
                                 limits)
    return plans
