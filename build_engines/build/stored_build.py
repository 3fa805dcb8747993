"""The bounded engine build: a checkpoint that stores fp8 / packed-fp4 weights (the release) into ONNX engines that
keep those bytes, at about one copy of a role's stored weights per process.

Why a build of its own: `build_onnx` exports step modules over fp32 weights (4-8x the stored bytes, ~1.1 TB per role
at full size), serializes each model whole, and checks it with the encoder and decoder modules alive together. Here:

1. each role runs in a process of its own (`spawn`, one task per process, so each peak is that role's alone), which
   loads the role with its weights as stored (`export.stored_role`: fp8 codes, packed fp4, e8m0 scales as uint8; bf16
   and f32 as they are; the Engram tables never read) and exports it with the weights streamed to `<graph>.data`
   one tensor at a time (`export_module(..., external_data=True)`; the dequantization stays in the graph);
2. the encoder's process also writes both roles' check inputs (a prefill chunk after a first one; a two-adapter
   replay from the encoder's hand-over and a random LoRA bank) to the engine directory;
3. a fresh process per role runs the graph on its inputs (onnxruntime with constant folding off, so the stored
   weights are not folded into fp32 copies, and without its arena) and writes its outputs and rounding taps to a file;
   then another fresh process loads the role again and runs the module, following the graph's fake-quant rounding
   ties as `build_onnx` does (`compare_following_rounding`).

No process holds two copies of a role's weights (the checkpoint is read into buffers of its own, not mapped:
`CheckpointFiles.get`); the dequantized weights exist one at a time (an expert chunk for the MoE), and every worker
returns freed buffers to the system (`return_freed_memory`). Each process's peak RSS (`VmHWM`) goes into the manifest
beside the role's stored bytes, so every build states its own memory figure. The roles run side by side on a machine
with more than one core (`MOL2_BUILD_WORKERS=0`: one after the other, for the smallest total).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from build_engines.build.onnx_build import (
    GRAPH_FILES,
    PARITY_BOUND,
    ParityError,
    check_cases,
    compare_following_rounding,
    export_graph,
    pointer_parity,
    run_tapped_graph,
)
from build_engines.export.graph_rounding import LazyArrays
from build_engines.export.onnx_export import export_sizes
from build_engines.export.stored_role import is_engram_table, load_stored_role, stored_bytes
from ced.formats.checkpoint import CheckpointFiles, role_tensor_names
from ced.formats.config_file import load_config
from ced.routing.pointer_head import load_router_head
from ced.steps.decoder_step import DecoderStep
from ced.steps.encoder_step import EncoderStep
from ced.steps.engram_feed import EngramFeed
from ced.steps.layout import GraphTensor, StepLayout
from ced.steps.parity import torch_runner
from ced.steps.pointer_step import PointerStep

ROLES = ("encoder", "decoder")
# the decoder check's random adapters (`check_cases`: two in one batch, slots 1 and 2) at rank 1. Why 1: the bank
# covers every expert of every decoder layer, so it grows with the model's shape (74 MB at rank 4 beside a 336 MB
# role); the LoRA arithmetic at higher ranks is the same graph code, checked at rank 4 by every fp32 build
# (`check_parity`)
CHECK_LORA_RANK = 1
# ... and its two sessions replay 13 tokens each (16 rows with padding, an odd length for the unpaired ratio-2 token),
# not the fp32 builds' 30 (32 rows). Why: onnxruntime's working set while it runs the decoder graph, and the
# rounding taps it returns, grow with rows x width (measured at 1024 x 512: about 1 MB per row beside a 336 MB role),
# and nothing in the check needs more rows: the dense expert layout runs every expert's weights on every row
CHECK_REPLAY_TOKENS = 13


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM): file-backed pages it touched included, so nothing hides in mmaps."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def return_freed_memory() -> None:
    """Worker initializer: a fixed mmap threshold for glibc's malloc (128 KB). Why: by default glibc raises the
    threshold to the size of each freed mapped block (up to 32 MB), after which dequantized weights and chunk copies
    of that size come from the heap, whose freed pages stay in RSS; fixed, every large buffer is its own mapping and
    leaves RSS when freed. No-op where the C library has no `mallopt`."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD; setting it also turns the dynamic threshold off
    except (OSError, AttributeError):
        pass


def role_checkpoint_bytes(model_dir: Path, role: str) -> int:
    """The role's share of the checkpoint: stored bytes of its tensors and their scales, Engram tables excluded (they
    stay on the host, memory-mapped, and no build reads them)."""
    files = CheckpointFiles(model_dir)
    names = [n for n in role_tensor_names(load_config(model_dir), role) if not is_engram_table(n)]
    return files.bytes_of(names)


def _io(layout: StepLayout, role: str) -> tuple[list[GraphTensor], list[GraphTensor]]:
    if role == "encoder":
        return layout.encoder_inputs(), layout.encoder_outputs()
    return layout.decoder_inputs(), layout.decoder_outputs()


def _stored_step(model_dir: Path, role: str) -> tuple[StepLayout, torch.nn.Module, int]:
    cfg, component = load_stored_role(model_dir, role)
    held = stored_bytes(component)
    step = (EncoderStep if role == "encoder" else DecoderStep)(component).eval()  # type: ignore[arg-type]
    return StepLayout(cfg), step, held


def _case_file(out: Path, role: str) -> Path:
    return out / f".parity_{role}_case.npz"


def export_role(model_dir: Path, role: str, out: Path) -> dict[str, Any]:
    """Worker: export one role from its stored weights (and, for the encoder, write both roles' check inputs)."""
    torch.set_num_threads(1)
    layout, step, held = _stored_step(model_dir, role)
    inputs, outputs = _io(layout, role)
    if role == "encoder":
        runner = torch_runner(step, inputs, outputs)
        engram = EngramFeed.open(model_dir, layout)
        cases = check_cases(layout, runner, engram, lora_rank=CHECK_LORA_RANK, replay_tokens=CHECK_REPLAY_TOKENS)
        for name, case in cases.items():
            np.savez(_case_file(out, name), **case)
        del runner, cases
    graph = export_graph(role, step, inputs, outputs, export_sizes(layout), out, external_data=True)
    graph["weights"] = {"held_bytes": held, "export_peak_rss_bytes": peak_rss_bytes()}
    return graph


def _graph_run_file(out: Path, role: str) -> Path:
    return out / f".parity_{role}_graph_run.npz"


def run_role_graph(role: str, out: Path) -> int:
    """Worker: the role's graph on its check inputs (onnxruntime, constant folding off, so the stored weights are not
    folded into fp32 copies); its outputs and rounding taps go to a file for the module's process. Returns the peak."""
    with np.load(_case_file(out, role)) as stored:
        case = {k: stored[k] for k in stored.files}
    got, taps = run_tapped_graph(out / GRAPH_FILES[role], case, fold_constants=False)
    np.savez(_graph_run_file(out, role), **{f"out_{k}": v for k, v in got.items()},
             **{f"tap_{i:06d}": v for i, v in enumerate(taps)})
    return peak_rss_bytes()


def check_role(model_dir: Path, role: str, out: Path) -> dict[str, Any]:
    """Worker: the module on the role's check inputs, following the graph's run (`run_role_graph`, another process)."""
    torch.set_num_threads(1)
    with np.load(_case_file(out, role)) as stored:
        case = {k: stored[k] for k in stored.files}
    layout, step, _ = _stored_step(model_dir, role)
    module = torch_runner(step, *_io(layout, role))
    rounding: dict[str, dict[str, int]] = {}
    with np.load(_graph_run_file(out, role)) as stored:  # the taps are read one at a time as the module reaches them
        got = {k[4:]: stored[k] for k in stored.files if k.startswith("out_")}
        taps = LazyArrays(stored, sorted(k for k in stored.files if k.startswith("tap_")))
        parity = compare_following_rounding(module, out / GRAPH_FILES[role], case, role, rounding,
                                            graph_run=(got, taps))
    return {"parity": parity, "rounding": rounding.get(role, {}), "check_peak_rss_bytes": peak_rss_bytes()}


def build_stored(model_dir: Path, out: Path) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, float]]]:
    """Export and check the encoder, decoder and pointer graphs of a stored-weight checkpoint into `out`; returns the
    graph descriptions (with each role's memory figures) and the parity figures, as `build_onnx` does."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(model_dir)
    layout = StepLayout(cfg)
    parallel = os.environ.get("MOL2_BUILD_WORKERS", "1") != "0" and (os.cpu_count() or 1) > 1
    context = multiprocessing.get_context("spawn")
    graphs: dict[str, dict[str, Any]] = {}
    parity: dict[str, dict[str, float]] = {}
    try:
        with tqdm(total=3 * len(ROLES) + 1, desc="stored-weight build", unit="step") as bar, \
                ProcessPoolExecutor(max_workers=2 if parallel else 1, mp_context=context, max_tasks_per_child=1,
                                    initializer=return_freed_memory) as pool:
            exports = {role: pool.submit(export_role, model_dir, role, out) for role in ROLES}
            head, _ = load_router_head(model_dir, cfg.dim)
            pointer = PointerStep(head).eval()
            graphs["pointer"] = export_graph("pointer", pointer, layout.pointer_inputs(cfg.dim, head.cfg.width),
                                             layout.pointer_outputs(), export_sizes(layout), out)
            parity["pointer"] = pointer_parity(out, layout, pointer, head)
            bar.update()
            for role, future in exports.items():
                graphs[role] = future.result()
                bar.update()
            tqdm.write("checking each graph against its module (onnxruntime CPU, stored weights)")
            runs = {role: pool.submit(run_role_graph, role, out) for role in ROLES}
            for role, future in runs.items():
                graphs[role]["weights"]["graph_run_peak_rss_bytes"] = future.result()
                bar.update()
            checks = {role: pool.submit(check_role, model_dir, role, out) for role in ROLES}
            for role, future in checks.items():
                check = future.result()
                parity[role] = check["parity"]
                graphs[role]["weights"]["check_peak_rss_bytes"] = check["check_peak_rss_bytes"]
                graphs[role]["weights"]["role_checkpoint_bytes"] = role_checkpoint_bytes(model_dir, role)
                if check["rounding"].get("roundings"):
                    graphs[role]["parity_fake_quant_rounding"] = check["rounding"]
                bar.update()
    finally:
        for role in ROLES:
            _case_file(out, role).unlink(missing_ok=True)
            _graph_run_file(out, role).unlink(missing_ok=True)
    worst = {name: max(d.values()) for name, d in parity.items()}
    if any(v > PARITY_BOUND for v in worst.values()):
        raise ParityError(f"exported graphs differ from their modules beyond {PARITY_BOUND}: {parity}")
    graphs = {name: graphs[name] for name in GRAPH_FILES}
    return graphs, {name: parity[name] for name in GRAPH_FILES}
