"""Build the ONNX engines of a checkpoint: export each step module, check it against the module, describe it."""

from __future__ import annotations

import collections
import multiprocessing
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from tqdm import tqdm

from build_engines.export.graph_rounding import FollowGraphRounding, RoundingMismatch, write_tapped_graph
from build_engines.export.onnx_export import data_file, export_module, export_sizes
from ced.engine_dir.manifest import sha256_file
from ced.formats.checkpoint import load_checkpoint
from ced.formats.drafter_files import load_drafter
from ced.model.network import DecoderEngine, EncoderEngine
from ced.routing.pointer_head import load_router_head
from ced.steps.decoder_step import DecoderStep
from ced.steps.draft_step import DraftMain, DraftStep
from ced.steps.encoder_step import EncoderStep
from ced.steps.engram_feed import EngramFeed
from ced.steps.layout import GraphTensor, StepLayout
from ced.steps.parity import Runner, decoder_case, encoder_case, max_difference, torch_runner
from ced.steps.pointer_step import PointerStep, option_inputs
from plugins import DOMAIN

PARITY_BOUND = 1e-3  # max abs difference between a graph and its module on the build's check inputs
GRAPH_FILES = {"encoder": "encoder.onnx", "decoder": "decoder.onnx", "pointer": "pointer.onnx"}
DRAFTER_FILE = "drafter.onnx"  # the DSpark drafter's graph, built when the checkpoint ships a drafter (draft_step.py)


class ParityError(RuntimeError):
    """An exported graph computes something else than the module it came from."""


def ort_runner(path: Path, fold_constants: bool = True):  # type: ignore[no-untyped-def]
    """A runner over the graph at `path` on onnxruntime's CPU provider, single-threaded. `fold_constants=False` keeps
    onnxruntime from folding a graph's stored-weight dequantization into fp32 copies at load (4-8x the stored bytes):
    what a bounded build's check needs."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    if not fold_constants:  # a bounded check: no arena, so a freed intermediate (a dequantized weight) leaves RSS
        options.enable_cpu_mem_arena = False
    disabled = [] if fold_constants else ["ConstantFolding"]
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"], disabled_optimizers=disabled)
    names = [o.name for o in session.get_outputs()]
    return lambda feed: dict(zip(names, session.run(None, {i.name: feed[i.name] for i in session.get_inputs()})))


def describe(model: onnx.ModelProto, path: Path, inputs: list[GraphTensor],
             outputs: list[GraphTensor]) -> dict[str, Any]:
    ops = collections.Counter(n.op_type for n in model.graph.node if n.domain == DOMAIN)
    data = data_file(path)
    return {
        "file": path.name,
        "sha256": sha256_file(path),
        "bytes": path.stat().st_size,
        **({"data_file": data.name, "data_sha256": sha256_file(data), "data_bytes": data.stat().st_size}
           if data.exists() else {}),
        "nodes": len(model.graph.node),
        "inlined_nodes": len(model.graph.node) + sum(ops[f.name] * (len(f.node) - 1) for f in model.functions),
        "custom_ops": dict(sorted(ops.items())),
        "functions": sorted(f.name for f in model.functions),
        "inputs": [{"name": t.name, "dtype": t.dtype, "dims": list(t.dims)} for t in inputs],
        "outputs": [{"name": t.name, "dtype": t.dtype, "dims": list(t.dims)} for t in outputs],
    }


def step_modules(
    model_dir: Path,
) -> tuple[StepLayout, dict[str, tuple[torch.nn.Module, list[GraphTensor], list[GraphTensor]]], torch.nn.Module]:
    """The checkpoint's step modules to export, by graph name (with their inputs and outputs), and the router head.
    A checkpoint with a DSpark drafter (`drafter_files`) also gets the drafter graph, and its decoder returns the
    drafter's `draft_main` rows."""
    net = load_checkpoint(model_dir)
    cfg = net.cfg
    drafter = load_drafter(model_dir)
    layout = StepLayout(cfg, None if drafter is None else drafter.spec)
    state = net.state_dict()
    head, _ = load_router_head(model_dir, cfg.dim)
    decoder = DecoderStep(DecoderEngine.from_state_dict(cfg, state).eval(),
                          None if drafter is None else DraftMain(drafter))
    modules = {
        "encoder": (EncoderStep(EncoderEngine.from_state_dict(cfg, state).eval()).eval(), layout.encoder_inputs(),
                    layout.encoder_outputs()),
        "decoder": (decoder.eval(), layout.decoder_inputs(), layout.decoder_outputs()),
        "pointer": (PointerStep(head).eval(), layout.pointer_inputs(cfg.dim, head.cfg.width), layout.pointer_outputs()),
    }
    if drafter is not None:
        modules["drafter"] = (DraftStep(drafter, net.embed, net.head).eval(), layout.drafter_inputs(),
                              layout.drafter_outputs())
    return layout, modules, head


def export_graph(name: str, module: torch.nn.Module, inputs: list[GraphTensor], outputs: list[GraphTensor],
                 sizes: dict[str, int], out: Path, external_data: bool = False) -> dict[str, Any]:
    """Export one step module as graph `name` into `out` and describe it."""
    t0 = time.perf_counter()
    path = out / (DRAFTER_FILE if name == "drafter" else GRAPH_FILES[name])
    graph = describe(export_module(module, inputs, outputs, sizes, path, external_data), path, inputs, outputs)
    graph["export_seconds"] = round(time.perf_counter() - t0, 1)
    return graph


def export_graph_from_checkpoint(model_dir: Path, name: str, out: Path) -> dict[str, Any]:
    """`build_onnx`'s worker: a spawned process has nothing of its parent's, so it loads the checkpoint itself."""
    layout, modules, _ = step_modules(model_dir)
    return export_graph(name, *modules[name], export_sizes(layout), out)


def build_onnx(model_dir: Path, out: Path) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, float]]]:
    """Export encoder, decoder and pointer graphs (and the drafter's, when the checkpoint ships one) into `out`;
    returns their descriptions and parity figures.

    Why a second process: each export is single-threaded Python (torch.onnx's tracer and optimizer), about a minute
    for the encoder and for the decoder on a 2-core CI machine, so the encoder, then the drafter, export in a
    spawned worker while this process exports the decoder and the pointer (`MOL2_BUILD_WORKERS=0` exports all
    here). The graphs do not depend on where they were exported (the manifest's hashes are the same)."""
    out.mkdir(parents=True, exist_ok=True)
    layout, modules, head = step_modules(model_dir)
    sizes = export_sizes(layout)
    names = [*GRAPH_FILES, *(["drafter"] if "drafter" in modules else [])]
    graphs: dict[str, dict[str, Any]] = {}
    in_worker = ([n for n in ("encoder", "drafter") if n in names]
                 if os.environ.get("MOL2_BUILD_WORKERS", "1") != "0" and (os.cpu_count() or 1) > 1 else [])
    with tqdm(total=len(names), desc="exporting", unit="graph") as bar, \
            ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pending = {name: pool.submit(export_graph_from_checkpoint, model_dir, name, out) for name in in_worker}
        for name in names:
            if name not in pending:
                graphs[name] = export_graph(name, *modules[name], sizes, out)
                bar.update()
        for name, future in pending.items():
            graphs[name] = future.result()
            bar.update()
    graphs = {name: graphs[name] for name in names}
    tqdm.write("checking each graph against its module (onnxruntime CPU)")
    rounding: dict[str, dict[str, int]] = {}
    parity = check_parity(out, layout, modules["encoder"][0], modules["decoder"][0], modules["pointer"][0], head,
                          EngramFeed.open(model_dir, layout), rounding)
    if "drafter" in modules:
        parity["drafter"] = drafter_parity(out, layout, modules["drafter"][0])
    worst = {name: max(d.values()) for name, d in parity.items()}
    if any(v > PARITY_BOUND for v in worst.values()):
        raise ParityError(f"exported graphs differ from their modules beyond {PARITY_BOUND}: {parity}")
    for name, figures in rounding.items():
        if figures["roundings"]:
            graphs[name]["parity_fake_quant_rounding"] = figures
    return graphs, parity


def run_tapped_graph(path: Path, feed: dict[str, np.ndarray],
                     fold_constants: bool = True) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """The graph at `path` on `feed`: its outputs, and the value of every fake-quant rounding it makes, in traced
    order (graph_rounding; none for a graph without fake-quant)."""
    tapped = path.with_name(f".{path.stem}.rounding.onnx")
    try:
        names = write_tapped_graph(path, tapped)
        got = ort_runner(tapped if names else path, fold_constants)(feed)
    finally:
        tapped.unlink(missing_ok=True)
    return got, [got.pop(n) for n in names]


def compare_following_rounding(module: Runner, path: Path, feed: dict[str, np.ndarray], what: str,
                               rounding: dict[str, dict[str, int]], fold_constants: bool = True,
                               graph_run: tuple[dict[str, np.ndarray], Sequence[np.ndarray]] | None = None,
                               ) -> dict[str, float]:
    """Max difference per output between the graph at `path` and its module on `feed`, the module taking the graph's
    side of fake-quant rounding ties (graph_rounding); a graph without fake-quant is compared as it is. The graph runs
    first and its session is gone before `module` is called; `graph_run` is that run when it was made elsewhere
    (`run_tapped_graph` in another process: the bounded build runs graph and module in processes of their own)."""
    got, taps = graph_run if graph_run is not None else run_tapped_graph(path, feed, fold_constants)
    follow = FollowGraphRounding(taps)
    del taps
    with follow.patched():
        want = module(feed)
    try:
        follow.check(what)
    except RoundingMismatch as e:
        raise ParityError(str(e)) from e
    rounding[what] = follow.figures()
    return max_difference(want, got)


def check_parity(out: Path, layout: StepLayout, encoder: EncoderStep, decoder: DecoderStep, pointer: PointerStep,
                 head: torch.nn.Module, engram: EngramFeed | None = None,
                 rounding: dict[str, dict[str, int]] | None = None) -> dict[str, dict[str, float]]:
    """`engram`: the checkpoint's Engram feed (rows from its memory-mapped tables), needed when the config has Engram.
    `rounding` receives, per graph, how many fake-quant roundings were compared and how many ties were followed."""
    rounding = {} if rounding is None else rounding
    enc_t = torch_runner(encoder, layout.encoder_inputs(), layout.encoder_outputs())
    cases = check_cases(layout, enc_t, engram)
    result = {"encoder": compare_following_rounding(enc_t, out / GRAPH_FILES["encoder"], cases["encoder"], "encoder",
                                                    rounding)}
    dec_t = torch_runner(decoder, layout.decoder_inputs(), layout.decoder_outputs())
    result["decoder"] = compare_following_rounding(dec_t, out / GRAPH_FILES["decoder"], cases["decoder"], "decoder",
                                                   rounding)
    result["pointer"] = pointer_parity(out, layout, pointer, head)
    return result


def check_cases(layout: StepLayout, encoder: Runner, engram: EngramFeed | None, lora_rank: int = 4,
                replay_tokens: int = 30) -> dict[str, dict[str, np.ndarray]]:
    """The inputs every build checks its encoder and decoder graphs on: a prefill chunk after a first one, and two
    sessions of `replay_tokens` each replayed in one batch under two different adapter slots of a random bank of
    `lora_rank` (random adapters: no checkpoint needed), the decoder's from `encoder`'s hand-over."""
    return {"encoder": encoder_case(layout, encoder, (37, 6), seed=0, engram=engram),
            "decoder": {**decoder_case(layout, encoder, replay_tokens, seed=1, slots=[1, 2], engram=engram),
                        **random_bank(layout, slots=3, rank=lora_rank)}}


def pointer_parity(out: Path, layout: StepLayout, pointer: PointerStep, head: torch.nn.Module) -> dict[str, float]:
    """The pointer graph against its module on random H19 and a small option set (masked options stay -inf)."""
    cfg = layout.cfg
    generator = torch.Generator().manual_seed(2)
    options = head.encode_options([torch.randn(7, cfg.dim, generator=generator),
                                   torch.randn(4, cfg.dim, generator=generator)])
    pfeed = {k: v.detach().numpy() for k, v in option_inputs(options).items()}
    pfeed["h19"] = torch.randn(3, cfg.dim, generator=generator).numpy()
    pfeed["option_mask"] = np.array([[True, True], [True, False], [False, True]])
    ptr_t = torch_runner(pointer, layout.pointer_inputs(cfg.dim, head.cfg.width), layout.pointer_outputs())
    a, b = ptr_t(pfeed), ort_runner(out / GRAPH_FILES["pointer"])(pfeed)
    finite = np.isfinite(a["logits"])
    return {"logits": float(np.abs(a["logits"][finite] - b["logits"][finite]).max())
            if np.array_equal(finite, np.isfinite(b["logits"])) else float("inf")}


def drafter_parity(out: Path, layout: StepLayout, drafter: DraftStep) -> dict[str, float]:
    """The drafter graph against its module on random rings of three rows with different fills (one full, one of a
    single row, one half): confidence as a difference, drafts as the share that differ (0 expected; 1 per wrong one)."""
    cfg = layout.cfg
    generator = torch.Generator().manual_seed(4)
    W = cfg.window_size
    feed = {"main_x": torch.randn(3, W, cfg.dim, generator=generator).numpy(),
            "main_count": np.array([W, 1, max(1, W // 2)], np.int64),
            "last_position": np.array([W + 40, 0, W // 2 + 3], np.int64),
            "last_token": np.array([1, cfg.vocab_size - 2, 7], np.int64)}
    want = torch_runner(drafter, layout.drafter_inputs(), layout.drafter_outputs())(feed)
    got = ort_runner(out / DRAFTER_FILE)(feed)
    return {"draft_confidence": float(np.abs(want["draft_confidence"] - got["draft_confidence"]).max()),
            "draft_tokens": float((want["draft_tokens"] != got["draft_tokens"]).mean())}


def random_bank(layout: StepLayout, slots: int, rank: int, seed: int = 3) -> dict[str, np.ndarray]:
    """A LoRA bank of `slots` slots (slot 0 zeros) filled with random factors, for checks without adapters on disk."""
    rng = np.random.default_rng(seed)
    bank = {}
    for g in layout.lora_groups():
        for prefix, shape in zip(("lora_a", "lora_b"), layout.lora_shapes(g, slots, rank)):
            array = (rng.standard_normal(shape) * 0.05).astype(np.float32)
            array[0] = 0.0
            bank[f"{prefix}.{g.name}"] = array
    return bank
