"""`python -m build_engines build`: a checkpoint in, an engine directory with its manifest out.

    python -m build_engines build --model embedded/mol2-small --out artifacts/engines/mol2-small
    python -m build_engines build --model DIR --out DIR --format trt        # needs TensorRT and an NVIDIA GPU
    python -m build_engines build --model DIR --out DIR --quant fp8       # ModelOpt PTQ (fp8 | int8; nvfp4 needs a GPU)
    python -m build_engines build --model DIR --out DIR --quant fp8 --kv-quant fp8   # and fp8 rings / global-KV stores
    python -m build_engines build --model RELEASE_DIR --out DIR --quant release
        # the release's fp8/fp4 weights as stored

Exit codes: 0 built or reused (an up-to-date directory is reused, say --force to rebuild), 1 the build failed,
2 bad use or a missing prerequisite (TensorRT for --format trt, a GPU for --quant nvfp4).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shlex
import sys
import time
from pathlib import Path

from build_engines.quantize import KV_QUANT_MODES, QUANT_MODES, QuantizationUnavailable, check_quant
from ced.engine_dir.manifest import (
    BuildSettings,
    builder_digest,
    source_digest,
    stale_reason,
    tool_versions,
    write_manifest,
)
from plugins.tensorrt_support import TensorRTUnavailable, require_tensorrt_plugin

FORMATS = ("onnx", "trt")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m build_engines build", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True,
                   help="checkpoint directory (config.json + model.safetensors [+ router/])")
    p.add_argument("--out", type=Path, required=True, help="engine directory to write (or reuse)")
    p.add_argument("--format", choices=FORMATS, default="onnx")
    p.add_argument("--quant", choices=QUANT_MODES, default="none")
    p.add_argument("--kv-quant", choices=KV_QUANT_MODES, default="none",
                   help="fp8: window rings and global-KV stores kept as fp8 e4m3 with per-tensor scales from the "
                        "calibration run (calibrated builds only: --quant fp8 | int8)")
    p.add_argument("--data", type=Path, default=Path("artifacts/data"),
                   help="prepared corpora, read for held-out text only when <model>/heldout/ is absent "
                        "(quantized builds)")
    p.add_argument("--reuse-fp32", type=Path, default=None,
                   help="quantized builds: take the fp32 graphs from this engine directory when it is up to date for "
                        "the same checkpoint (skips the export, about a minute), else export them")
    p.add_argument("--expert-chunk-bytes", type=int, default=None,
                   help="checkpoints with fp8/fp4 weights: most fp32 bytes of routed experts one MoE dequantizes at "
                        "once (at least one expert; default 16 MiB). Smaller: less memory in flight, more graph nodes")
    p.add_argument("--force", action="store_true", help="rebuild even when the directory is up to date")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="N > 1: write each rank's slices of the encoder and decoder weights for the torch engine's "
                        "multi-rank serving (rank<r>/<role>.safetensors + manifest.json; docs/parallel.md)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tensor-parallel-size: whole experts per rank")
    p.add_argument("--max-batch", type=int, default=64, help="TensorRT profiles: most rows per step")
    p.add_argument("--max-context", type=int, default=8192, help="TensorRT profiles: longest session")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.tensor_parallel_size != 1 or args.enable_expert_parallel:
        return build_ranks(args)
    try:
        check_quant(args.quant, args.kv_quant, args.format)
        if args.format == "trt":
            require_tensorrt_plugin()  # fail before minutes of export
    except (QuantizationUnavailable, TensorRTUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.expert_chunk_bytes is not None and args.expert_chunk_bytes < 1:
        print(f"error: --expert-chunk-bytes {args.expert_chunk_bytes}: expected a positive number of bytes",
              file=sys.stderr)
        return 2
    if not (args.model / "config.json").exists():
        print(f"error: {args.model} is not a checkpoint directory (no config.json)", file=sys.stderr)
        return 2
    from ced.steps.opset import OPSET

    settings = BuildSettings(args.format, args.quant, OPSET, args.kv_quant, args.expert_chunk_bytes)
    if args.expert_chunk_bytes is not None:  # the stored build's workers are spawned: they read it from the environment
        from ced.steps.stored_weights import EXPERT_CHUNK_ENV  # here, not at the top: it imports torch

        os.environ[EXPERT_CHUNK_ENV] = str(args.expert_chunk_bytes)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two builders of one directory take turns; the second finds it current
        reason = stale_reason(args.out, args.model, settings)
        if reason is None and not args.force:
            print(f"engines in {args.out} are up to date (manifest matches checkpoint, settings and builder); "
                  "reusing them")
            return 0
        print(f"building {args.format} engines for {args.model} into {args.out} ({reason or 'forced'})", flush=True)
        try:
            manifest = build(args, settings)
        except Exception as exc:  # noqa: BLE001 - one clear line, the traceback only with --verbose-like runs
            print(f"error: the build failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        write_manifest(args.out, manifest)
    for name, graph in manifest["graphs"].items():
        print(f"  {name:8s} {graph['file']:14s} {graph['bytes'] / 1e6:6.1f} MB  {graph.get('nodes', '-')} nodes  "
              f"mol2 ops {graph.get('custom_ops', {})}")
    print(f"wrote {args.out / 'manifest.json'} in {manifest['build_seconds']:.0f} s")
    return 0


def build_ranks(args: argparse.Namespace) -> int:
    """`--tensor-parallel-size N`: rank-local weights for the torch engine (`rank_build.py`), not graphs."""
    N = args.tensor_parallel_size
    if N < 2:
        print(f"error: --tensor-parallel-size {N}: rank-local weights need 2 or more ranks (expert parallel too)",
              file=sys.stderr)
        return 2
    if args.format != "onnx" or args.quant != "none" or args.kv_quant != "none":
        print("error: --tensor-parallel-size writes rank-local weights for the torch engine, the one that serves "
              "several ranks; --format trt, --quant and --kv-quant do not apply (rank-local TensorRT engines need NCCL "
              "plugin collectives: docs/parallel.md)", file=sys.stderr)
        return 2
    if not (args.model / "config.json").exists():
        print(f"error: {args.model} is not a checkpoint directory (no config.json)", file=sys.stderr)
        return 2
    from build_engines.build.rank_build import build_rank_shards
    from ced.engine_dir.rank_manifest import stale_reason as ranks_stale_reason
    from ced.formats.config_file import load_config
    from ced.parallel.layout import ParallelLayout, ParallelLayoutError

    try:
        ParallelLayout(N, 0, args.enable_expert_parallel).check(load_config(args.model))
    except ParallelLayoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        reason = ranks_stale_reason(args.out, args.model, N, args.enable_expert_parallel)
        if reason is None and not args.force:
            print(f"rank-local weights in {args.out} are up to date; reusing them")
            return 0
        print(f"writing rank-local weights of {args.model} for {N} ranks into {args.out} ({reason or 'forced'})",
              flush=True)
        manifest = build_rank_shards(args.model, args.out, N, args.enable_expert_parallel)
        write_manifest(args.out, manifest)
    for entry in manifest["ranks"]:
        sizes = ", ".join(f"{role} {size / 1e6:.1f} MB" for role, size in entry["bytes"].items())
        print(f"  rank {entry['rank']}: {sizes}")
    print(f"wrote {args.out / 'manifest.json'} in {manifest['build_seconds']:.0f} s")
    return 0


def build(args: argparse.Namespace, settings: BuildSettings) -> dict:
    from build_engines.build.onnx_build import build_onnx
    from build_engines.export.stored_role import stores_quantized
    from ced.formats.checkpoint import load_config
    from ced.formats.drafter_files import drafter_spec
    from ced.steps.layout import StepLayout

    t0 = time.time()
    model_dir = args.model.resolve()
    onnx_dir = args.out / "onnx" if args.format == "trt" else args.out
    quant = None
    if args.quant == "none" and stores_quantized(model_dir):  # the release's fp8/fp4 bytes kept, bounded memory
        from build_engines.build.stored_build import build_stored

        graphs, parity = build_stored(model_dir, onnx_dir)
    elif args.quant == "none":
        graphs, parity = build_onnx(model_dir, onnx_dir)
    elif args.quant == "release":
        from build_engines.build.release_build import build_release

        graphs, parity, quant = build_release(model_dir, onnx_dir)
    else:  # fp32 graphs first (checked against their modules), then ModelOpt PTQ of them into the engine directory
        import shutil

        from build_engines.build.quant_build import build_quantized
        from ced.engine_dir.manifest import read_manifest

        reuse = args.reuse_fp32
        if reuse is not None and stale_reason(reuse, model_dir, BuildSettings("onnx", "none", settings.opset)) is None:
            print(f"taking the fp32 graphs from {reuse} (up to date)", flush=True)
            fp32 = read_manifest(reuse) or {}
            graphs, quant = build_quantized(model_dir, reuse, fp32["graphs"], onnx_dir, args.quant, args.data,
                                            args.kv_quant)
            parity = fp32["parity_max_abs"]
        else:
            fp32_dir = args.out / ".fp32"
            try:
                fp32_graphs, parity = build_onnx(model_dir, fp32_dir)
                graphs, quant = build_quantized(model_dir, fp32_dir, fp32_graphs, onnx_dir, args.quant, args.data,
                                                args.kv_quant)
            finally:
                shutil.rmtree(fp32_dir, ignore_errors=True)
    drafter = drafter_spec(model_dir) if "drafter" in graphs else None  # the build made a drafter graph
    if args.format == "trt":
        from build_engines.build.trt_build import TrtLimits, build_trt

        layout = StepLayout(load_config(model_dir), drafter)
        plans = build_trt(onnx_dir, args.out, layout, graphs, args.quant, TrtLimits(args.max_batch, args.max_context))
        for name in graphs:
            graphs[name] = {**plans[name], "onnx": {**graphs[name], "file": f"onnx/{graphs[name]['file']}"}}
    cfg = load_config(model_dir)
    return {
        "settings": settings.as_dict(),
        "exporter": "torch.onnx.export(dynamo=True), mol2 ops as local functions",
        "source": {"model_dir": str(model_dir), "files": source_digest(model_dir, args.quant)},
        "builder": {"code_digest": builder_digest(args.quant), **tool_versions()},
        "config": cfg.to_dict(),
        "graphs": graphs,
        "parity_max_abs": parity,
        **({"quant": quant} if quant else {}),
        **({"drafter": drafter.to_release()} if drafter is not None else {}),
        "command": "python -m build_engines build " + shlex.join(
            ["--model", str(args.model), "--out", str(args.out), "--format", args.format, "--quant", args.quant]
            + (["--kv-quant", args.kv_quant] if args.kv_quant != "none" else [])
        ),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "build_seconds": round(time.time() - t0, 1),
    }


if __name__ == "__main__":
    sys.exit(main())
