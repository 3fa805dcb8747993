"""Device check of the mol2 Triton kernels on an NVIDIA GPU (driven by `bash scripts/device_check.sh`).

    PYTHONPATH=. python3 -m benchmarks device-check [--out docs/kernels.md] [--json results.json] [--iters 10] \
        [--no-model]

1. Every kernel against its PyTorch reference at DeepSeek-V4.1-Flash shapes (64 heads, head dim 512, window 128 +
   top-512 global entries; batch 1 / 16 / 64; decode S = 1 and replay / prefill S = 128; fp32 and bf16), at the small
   embedded model's shapes, and the PointerScore at a realistic option set (w = 2048, 4 heads, 64 options x 32
   tokens); outputs are NaN-poisoned before each launch and must come back fully written. Any disagreement makes
   the script exit 1 after printing what disagreed.
2. Timing with CUDA events (L2 flushed before every timed launch), achieved bandwidth on the bytes a kernel must
   move (q, the distinct key rows its lists name, the lists, the output; every input for PointerScore) against this
   GPU's measured device-to-device copy bandwidth, and a small sweep of launch configurations (each one checked too).
3. The ahead-of-time compiled kernels (what the TensorRT `aot_impl` returns) launched with exactly their declared
   arguments and checked against the reference.
4. The torch CUDA path of the whole embedded model (EncoderStep + DecoderStep per decoded token, the engines'
   runtime loop, every mol2 op going to its Triton kernel): decode tokens/s at batch 1 / 16 / 64.

Results are printed and written into the "## Measured on a GPU" section of docs/kernels.md. Needs torch with CUDA and
OpenAI Triton; installs nothing. `--dry-run` runs the same code on CPU at tiny shapes (kernels under
TRITON_INTERPRET=1, the script sets it) to check the script itself; it writes no docs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from benchmarks.harness import ROOT

SECTION = "## Measured on a GPU"


def preflight(dry_run: bool) -> tuple[Any, str] | str:
    """(torch, device) or the reason this machine cannot run the check."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not importable ({exc}); the check needs torch with CUDA and OpenAI Triton"
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"OpenAI Triton is not importable ({exc}); install it alongside a CUDA torch"
    if dry_run:
        return torch, "cpu"
    if not torch.cuda.is_available():
        return (f"no CUDA device here (torch {torch.__version__}, built for CUDA {torch.version.cuda}, reports "
                "torch.cuda.is_available() == False); run this on an NVIDIA GPU machine")
    if os.environ.get("TRITON_INTERPRET"):
        return "TRITON_INTERPRET is set: the kernels would run in Triton's CPU interpreter; unset it"
    return torch, "cuda"


# ----------------------------------------------------------------------------------------------- timing


class Timer:
    def __init__(self, torch: Any, device: str, iters: int) -> None:
        self.torch, self.device, self.iters = torch, device, iters
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device == "cuda" else None  # > L2

    def __call__(self, fn: Callable[[], Any], iters: int | None = None, warmup: int = 2) -> float:
        """Median seconds of one call of fn, L2 flushed before each timed call (CUDA events on the GPU)."""
        torch = self.torch
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters or self.iters):
            if self.device == "cuda":
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def copy_bandwidth(torch: Any, device: str, timer: Timer) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted), timed like the kernels."""
    n = (1 << 30) if device == "cuda" else (1 << 22)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timer(lambda: dst.copy_(src))
    return 2 * n / seconds


# ----------------------------------------------------------------------------------------------- inputs


def attention_inputs(torch: Any, device: str, op: str, B: int, S: int, H: int, D: int, W: int, K: int, Tg: int,
                     dtype: Any, seed: int) -> dict[str, Any]:
    """Index lists shaped like the network's: a W-row window (oldest first) then top-K global entries.

    sparse / S = 1: a decode step (full ring, then this row); sparse / S > 1: the decoder's bounded replay (empty
    ring: query s sees the chunk rows 0..s only) with K distinct random global entries per query.
    swa: a full ring plus a chunk of S rows (decode or a prefill chunk), window only."""
    g = torch.Generator(device=device).manual_seed(seed)
    Tl = W + S
    s = torch.arange(S, device=device).view(1, S, 1)
    j = torch.arange(W, device=device).view(1, 1, W)
    pos = s - (W - 1) + j  # chunk-relative position of window entry j for query s (negative: before the chunk)
    in_chunk = W + pos  # local row of a chunk position
    replay = op == "sparse" and S > 1
    ring = -1 if replay else (pos % W)  # ring slot of an earlier position (the ring holds the last W before the chunk)
    window = torch.where(pos >= 0, in_chunk, torch.as_tensor(ring, device=device)).expand(B, S, W).contiguous()
    parts = [window]
    tables: list[Any] = [torch.randn(B, Tl if op == "sparse" else W + S, D, generator=g, device=device).to(dtype)]
    if op == "sparse":
        top = torch.rand(B * S, Tg, generator=g, device=device).topk(K, dim=-1).indices.view(B, S, K)
        parts.append(top + Tl)
        tables.append(torch.randn(B, Tg, D, generator=g, device=device).to(dtype))
    return {
        "q": torch.randn(B, S, H, D, generator=g, device=device).to(dtype),
        "tables": tables,
        "idx": torch.cat(parts, -1).contiguous(),
        "sink": torch.randn(H, generator=g, device=device).to(dtype),
        "scale": D ** -0.5,
    }


def pointer_inputs(torch: Any, device: str, B: int, w: int, heads: int, n: int, T: int, seed: int) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(seed)
    HL = heads * n * T
    attn_bias = torch.randn(HL, generator=g, device=device)
    pad = torch.rand(heads, n, T, generator=g, device=device) < 0.25
    pad[:, :, 0] = False
    attn_bias.view(heads, n, T)[pad] = float("-inf")
    mask = torch.rand(B, n, generator=g, device=device) < 0.5
    mask[:, 0] = True
    return {"x": torch.randn(B, w, generator=g, device=device), "xn": torch.randn(B, w, generator=g, device=device),
            "attn_query": torch.randn(w, HL, generator=g, device=device) * w ** -0.5, "attn_bias": attn_bias,
            "point_query": torch.randn(w, n, generator=g, device=device) * w ** -0.5,
            "point_read": torch.randn(HL, n, generator=g, device=device),
            "point_bias": torch.randn(n, generator=g, device=device), "option_mask": mask, "heads": heads}


POINTER_ARGS = ("x", "xn", "attn_query", "attn_bias", "point_query", "point_read", "point_bias", "option_mask")


# ----------------------------------------------------------------------------------------------- attention cases


def attention_reference(torch: Any, op: str, case: dict[str, Any], rows_per_call: int) -> Any:
    """The reference, over slices of the batch so the gathered keys (B, S, J, D) stay a few GB at most."""
    from plugins.sparse_global_attention.reference import sparse_global_attention_reference
    from plugins.swa_replay_attention.reference import swa_replay_attention_reference

    ref = sparse_global_attention_reference if op == "sparse" else swa_replay_attention_reference
    B = case["q"].shape[0]
    parts = []
    for b0 in range(0, B, rows_per_call):
        sl = slice(b0, b0 + rows_per_call)
        parts.append(ref(case["q"][sl], *[t[sl] for t in case["tables"]], case["idx"][sl], case["sink"], case["scale"]))
    return torch.cat(parts)


def attention_error(torch: Any, got: Any, want: Any, dtype: Any) -> tuple[float, float]:
    """(max abs error, the metric the tolerance applies to): abs for fp32, abs / (1 + |want|) for 16-bit."""
    diff = (got.float() - want.float()).abs()
    if dtype == torch.float32:
        return float(diff.max()), float(diff.max())
    return float(diff.max()), float((diff / (1 + want.float().abs())).max())


def attention_bytes(torch: Any, case: dict[str, Any]) -> tuple[int, int]:
    """(bytes the kernel must move, flops): q + out + lists + sink + each batch row's distinct valid key rows."""
    q, idx = case["q"], case["idx"]
    B, S, H, D = q.shape
    key_bytes = case["tables"][0].element_size()
    rows = 0
    for b in range(B):
        rows += int(torch.unique(idx[b][idx[b] >= 0]).numel())
    valid = int((idx >= 0).sum())
    total = (2 * q.numel() * q.element_size() + idx.numel() * 8 + case["sink"].numel() * case["sink"].element_size()
             + rows * D * key_bytes)
    return total, 4 * valid * H * D


def run_attention(op: str, case: dict[str, Any], config: Any = None, out: Any = None) -> Any:
    """One launch; without `out`, into a fresh NaN-poisoned buffer (the checks), else into `out` (the timings)."""
    import torch

    if out is None:
        out = torch.full(case["q"].shape, float("nan"), dtype=case["q"].dtype, device=case["q"].device)
    if op == "sparse":
        from plugins.sparse_global_attention.kernel import launch

        launch(case["q"], *case["tables"], case["idx"], case["sink"], case["scale"], out, config)
    else:
        from plugins.swa_replay_attention.kernel import launch

        launch(case["q"], case["tables"][0], case["idx"], case["sink"], case["scale"], out, config)
    return out


def dtypes(torch: Any) -> dict[str, Any]:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# None: reported, never a failure (TF32 is an opt-in trade)
TOLERANCE = {"fp32": 5e-5, "bf16": 2e-2, "fp16": 2e-2, "tf32": None}


class Report:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.notes: list[str] = []

    def check(self, label: str, metric: float, tol: float | None) -> bool:
        ok = tol is None or metric <= tol
        if not ok:
            self.failures.append(f"{label}: error {metric:.3g} > tolerance {tol:g}")
        return ok


def attention_cases(torch: Any, device: str, report: Report, timer: Timer, copy_bw: float, dry: bool) -> None:
    from plugins.sparse_global_attention.kernel import config_for, fp32_math

    H, D, W, K, Tg = (64, 512, 128, 512, 16384) if not dry else (5, 40, 8, 12, 64)
    S_long = 128 if not dry else 6
    batches = (1, 16, 64) if not dry else (1, 3)
    small = (4, 64, 128, 32, 2048)  # the embedded model's attention (mol2-small)
    half = "fp16" if dry else "bf16"  # Triton's interpreter (the dry run) computes bf16 dots wrongly
    plan = []
    for op in ("sparse", "swa"):
        for S in (1, S_long):
            for B in batches:
                for dt in ("fp32", half):
                    plan.append((op, "decode" if S == 1 else ("replay" if op == "sparse" else "prefill"), B, S, dt,
                                 (H, D, W, K, Tg)))
    if not dry:
        for B in (1, 64):
            plan.append(("sparse", "decode, mol2-small", B, 1, "fp32", small))
    seed = 1234
    for op, phase, B, S, dt, (h, d, w, k, tg) in plan:
        seed += 1
        dtype = dtypes(torch)[dt]
        case = attention_inputs(torch, device, op, B, S, h, d, w, k, tg, dtype, seed)
        got = run_attention(op, case)
        label = f"{op} {phase} B={B} S={S} {dt}"
        written = not bool(got.isnan().any())
        if not written:
            report.failures.append(f"{label}: output not fully written (NaN left)")
        want = attention_reference(torch, op, case, rows_per_call=max(1, 8 if S > 1 else 64))
        err, metric = attention_error(torch, got, want, dtype)
        ok = report.check(label, metric, TOLERANCE[dt]) and written
        moved, flops = attention_bytes(torch, case)
        buffer = torch.empty_like(got)
        seconds = timer(lambda case=case, op=op, buffer=buffer: run_attention(op, case, None, buffer))
        cfg = config_for(h, d, fp32_math(case["q"], *case["tables"]))
        gathered = B * S * case["idx"].shape[2] * d * 4
        ref_s = (timer(lambda case=case, op=op: attention_reference(torch, op, case, B), iters=3, warmup=1)
                 if gathered < (8 << 30) else None)
        report.rows.append({"kind": "attention", "label": label, "op": op, "phase": phase, "B": B, "S": S, "dtype": dt,
                            "H": h, "D": d, "J": int(case["idx"].shape[2]), "max_error": err, "ok": ok,
                            "seconds": seconds, "bytes": moved, "flops": flops, "gb_s": moved / seconds / 1e9,
                            "of_copy": moved / seconds / copy_bw, "tflops": flops / seconds / 1e12,
                            "config": vars(cfg).copy(), "reference_seconds": ref_s})
        del case, got, want, buffer
        if device == "cuda":
            torch.cuda.empty_cache()


def sweep(torch: Any, device: str, report: Report, timer: Timer, copy_bw: float, dry: bool) -> None:
    """Alternative launch configurations at B = 64 (decode and replay), each checked against the reference."""
    from plugins.sparse_global_attention.kernel import Config, config_for

    H, D, W, K, Tg = (64, 512, 128, 512, 16384) if not dry else (5, 40, 8, 12, 64)
    B, S_long = (64, 128) if not dry else (2, 6)
    candidates = {
        "fp32": [(16, 16, 4, 1), (16, 16, 8, 1), (16, 32, 4, 1), (16, 16, 4, 2), (16, 32, 8, 1)],
        "fp16" if dry else "bf16": [(16, 32, 4, 2), (16, 16, 4, 2), (16, 64, 4, 2), (16, 32, 8, 3), (32, 32, 8, 2),
                                    (64, 32, 8, 2)],
    }
    seed = 777
    for S in (1, S_long):
        for dt, shapes in candidates.items():
            dtype = dtypes(torch)[dt]
            seed += 1
            case = attention_inputs(torch, device, "sparse", B, S, H, D, W, K, Tg, dtype, seed)
            want = attention_reference(torch, "sparse", case, rows_per_call=8)
            moved, flops = attention_bytes(torch, case)
            default = config_for(H, D, dt == "fp32")
            configs = [Config(bh, bj, default.block_d, nw, ns) for bh, bj, nw, ns in shapes]
            if dt == "fp32":
                configs.append(Config(default.block_h, default.block_j, default.block_d, default.num_warps,
                                      default.num_stages, "tf32"))
            for cfg in configs:
                label = (f"sweep sparse S={S} B={B} {dt} "
                         f"{cfg.block_h}/{cfg.block_j}/w{cfg.num_warps}/s{cfg.num_stages}/"
                         f"{cfg.fp32_dot if dt == 'fp32' else '-'}")
                try:
                    got = run_attention("sparse", case, cfg)
                except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is reported, not fatal
                    report.rows.append({"kind": "sweep", "label": label, "S": S, "dtype": dt,
                                        "config": vars(cfg).copy(),
                                        "error_text": f"{type(exc).__name__}: {str(exc)[:160]}"})
                    continue
                err, metric = attention_error(torch, got, want, dtype)
                tol = TOLERANCE["tf32"] if cfg.fp32_dot == "tf32" and dt == "fp32" else TOLERANCE[dt]
                ok = report.check(label, metric, tol) and not bool(got.isnan().any())
                seconds = timer(lambda cfg=cfg, case=case, got=got: run_attention("sparse", case, cfg, got))
                report.rows.append({"kind": "sweep", "label": label, "S": S, "B": B, "dtype": dt,
                                    "config": vars(cfg).copy(), "default": cfg == default, "max_error": err, "ok": ok,
                                    "seconds": seconds, "gb_s": moved / seconds / 1e9,
                                    "of_copy": moved / seconds / copy_bw, "tflops": flops / seconds / 1e12})
            del case, want
            if device == "cuda":
                torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------- pointer


def pointer_cases(torch: Any, device: str, report: Report, timer: Timer, copy_bw: float, dry: bool) -> None:
    from plugins.pointer_score.kernel import launch
    from plugins.pointer_score.reference import pointer_score_reference

    w, heads, n, T = (2048, 4, 64, 32) if not dry else (40, 3, 6, 4)
    for B in ((1, 16, 64) if not dry else (1, 5)):
        p = pointer_inputs(torch, device, B, w, heads, n, T, seed=99 + B)
        args = [p[k] for k in POINTER_ARGS]
        want = pointer_score_reference(*args, heads)
        moved = sum(t.numel() * t.element_size() for t in args) + B * n * 4
        ref_s = timer(lambda args=args: pointer_score_reference(*args, heads))
        for fused in (False, True):
            out = torch.full((B, n), float("nan"), device=device)
            launch(*args, heads, out, fused=fused)
            label = f"pointer B={B} {'fused (AOT form)' if fused else 'two kernels'}"
            fin = torch.isfinite(want)
            same_inf = bool(torch.equal(torch.isinf(out), torch.isinf(want))) and not bool(out.isnan().any())
            err = float((out[fin] - want[fin]).abs().max()) if bool(fin.any()) else 0.0
            scale = max(1.0, float(want[fin].abs().max())) if bool(fin.any()) else 1.0
            ok = report.check(label, err / scale, 1e-5) and same_inf
            if not same_inf:
                report.failures.append(f"{label}: -inf pattern differs from the reference (or NaN left)")
            seconds = timer(lambda args=args, out=out, fused=fused: launch(*args, heads, out, fused=fused))
            report.rows.append({"kind": "pointer", "label": label, "B": B, "fused": fused, "w": w, "heads": heads,
                                "n": n, "T": T, "max_error": err, "ok": ok, "seconds": seconds, "bytes": moved,
                                "gb_s": moved / seconds / 1e9, "of_copy": moved / seconds / copy_bw,
                                "reference_seconds": ref_s})


# ----------------------------------------------------------------------------------------------- AOT kernels


def aot_cases(torch: Any, device: str, report: Report) -> None:
    """Compile each kernel as the TensorRT aot_impl does (for this GPU), launch the compiled kernel with exactly its
    declared arguments (inputs, int32 extras, output; constexprs are baked in), check it; and the sm_90 PTX sizes."""
    import plugins.pointer_score.trt as ptrt
    import plugins.sparse_global_attention.trt as strt
    import plugins.swa_replay_attention.trt as wtrt
    from plugins.pointer_score.reference import pointer_score_reference

    major, minor = torch.cuda.get_device_capability()
    target = (major * 10 + minor, 32)
    H, D, W, K, Tg, B = 64, 512, 128, 512, 16384, 16
    for dt, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for op, module in (("sparse", strt), ("swa", wtrt)):
            label = f"AOT {op} {dt} B={B} S=1 (sm_{target[0]})"
            try:
                kernel = module.compile_kernel(target, dtype=dt, heads=H, head_dim=D)
                cfg = kernel.config
                case = attention_inputs(torch, device, op, B, 1, H, D, W, K, Tg, dtype, seed=5)
                out = torch.full(case["q"].shape, float("nan"), dtype=dtype, device=device)
                grid = ((H + cfg.block_h - 1) // cfg.block_h, B, 1)
                dims = [1, H, D, *[t.shape[1] for t in case["tables"]], case["idx"].shape[2]]  # S H D (Tl Tg | T) J
                constexprs = [D ** -0.5, dt == "fp32", cfg.fp32_dot, cfg.block_h, cfg.block_j, cfg.block_d]
                kernel.compiled[grid](case["q"], *case["tables"], case["idx"], case["sink"], *dims, out, *constexprs)
                want = attention_reference(torch, op, case, 64)
                err, metric = attention_error(torch, out, want, dtype)
                ok = report.check(label, metric, TOLERANCE[dt]) and not bool(out.isnan().any())
                report.rows.append({"kind": "aot", "label": label, "max_error": err, "ok": ok,
                                    "ptx_bytes": len(kernel.ptx), "shared": kernel.shared, "name": kernel.name})
            except Exception as exc:  # noqa: BLE001 - reported as a failure with the reason
                report.failures.append(f"{label}: {type(exc).__name__}: {exc}")
                report.notes.append(traceback.format_exc())
    label = f"AOT pointer fused B=16 (sm_{target[0]})"
    try:
        kernel = ptrt.compile_kernel(target, options=64)
        cfg = kernel.config
        p = pointer_inputs(torch, device, 16, 2048, 4, 64, 32, seed=8)
        args = [p[k] for k in POINTER_ARGS]
        out = torch.full((16, 64), float("nan"), device=device)
        grid = ((16 + cfg.block_b - 1) // cfg.block_b, 1, 1)
        extras = [16, 2048, 64, p["attn_bias"].shape[0], 4]  # B w n HL heads
        kernel.compiled[grid](*args, *extras, out, None, True, cfg.block_b, cfg.block_l, cfg.block_w, cfg.block_n)
        want = pointer_score_reference(*args, 4)
        fin = torch.isfinite(want)
        err = float((out[fin] - want[fin]).abs().max())
        same_inf = bool(torch.equal(torch.isinf(out), torch.isinf(want)))
        ok = report.check(label, err / max(1.0, float(want[fin].abs().max())), 1e-5) and same_inf
        if not same_inf:
            report.failures.append(f"{label}: -inf pattern differs from the reference (or NaN left)")
        report.rows.append({"kind": "aot", "label": label, "max_error": err, "ok": ok, "ptx_bytes": len(kernel.ptx),
                            "shared": kernel.shared, "name": kernel.name})
    except Exception as exc:  # noqa: BLE001
        report.failures.append(f"{label}: {type(exc).__name__}: {exc}")
        report.notes.append(traceback.format_exc())
    for op, module in (("sparse", strt), ("swa", wtrt), ("pointer", ptrt)):
        kernel = module.compile_kernel((90, 32))
        report.rows.append({"kind": "ptx", "label": f"{op} fp32, sm_90 PTX", "ptx_bytes": len(kernel.ptx),
                            "shared": kernel.shared, "num_warps": kernel.num_warps, "name": kernel.name})


# ----------------------------------------------------------------------------------------------- the whole model


def move_plain_tensors(obj: Any, device: Any, seen: set[int] | None = None) -> None:
    """Move tensors the step modules keep outside parameters and buffers (derived weights, RoPE frequencies)."""
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.nn.Module):
        obj.to(device)
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else \
        vars(obj).items() if hasattr(obj, "__dict__") and not isinstance(obj, type) else ()
    for key, value in list(items):
        if (isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
                and value.device != torch.device(device)):
            if isinstance(obj, torch.nn.Module) and (key in obj._buffers or key in obj._parameters):
                continue
            if isinstance(obj, (dict, list)):
                obj[key] = value.to(device)
            else:
                setattr(obj, key, value.to(device))
        elif isinstance(value, (dict, list, torch.nn.Module)) or (
                hasattr(value, "__dict__") and type(value).__module__.startswith("build_engines")):
            move_plain_tensors(value, device, seen)


def model_throughput(torch: Any, device: str, report: Report, dry: bool) -> dict[str, Any]:
    """Decode tokens/s of the embedded model's step modules on `device` (the engines' runtime loop, batched)."""
    import numpy as np

    from ced.formats.checkpoint import load_checkpoint
    from ced.lora import AdapterBank
    from ced.model.network import DecoderEngine, EncoderEngine
    from ced.steps.decoder_step import DecoderStep
    from ced.steps.encoder_step import EncoderStep
    from ced.steps.layout import StepLayout
    from ced.steps.lora_stacked import stack_adapters
    from ced.steps.step_loop import StepLoop

    model = ROOT / "embedded" / "mol2-small"
    cpu_net = load_checkpoint(model)
    cfg = cpu_net.cfg
    _, cpu_dec = cpu_net.split()
    adapters = AdapterBank(cfg, cpu_dec).load_bundled(model)
    bank = stack_adapters(StepLayout(cfg), [None, *[adapters[k] for k in sorted(adapters)]])
    slots_available = len(adapters)

    def steps(dev: str) -> tuple[Any, Any, Any]:
        with torch.device(dev):
            state = load_checkpoint(model, device=dev).state_dict()
            enc = EncoderEngine.from_state_dict(cfg, state).eval()
            dec = DecoderEngine.from_state_dict(cfg, state).eval()
            move_plain_tensors(enc, dev)
            move_plain_tensors(dec, dev)
            e, d = EncoderStep(enc).eval(), DecoderStep(dec).eval()
            move_plain_tensors(e, dev)
            move_plain_tensors(d, dev)
        return e, d, e.layout

    def runner(module: Any, specs: list, outputs: list,
               dev: str) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
        @torch.no_grad()
        def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            with torch.device(dev):
                args = [torch.from_numpy(np.ascontiguousarray(feed[t.name])).to(dev) for t in specs]
                result = module(*args)
            result = result if isinstance(result, tuple) else (result,)
            return {t.name: r.cpu().numpy() for t, r in zip(outputs, result)}

        return run

    e, d, layout = steps(device)
    enc_run = runner(e, layout.encoder_inputs(), layout.encoder_outputs(), device)
    dec_run = runner(d, layout.decoder_inputs(), layout.decoder_outputs(), device)
    results: dict[str, Any] = {"device": device}
    prompt_len, decode_steps = (256, 32) if not dry else (24, 3)
    for B in ((1, 16, 64) if not dry else (1, 2)):
        rng = np.random.default_rng(B)
        prompt = rng.integers(0, cfg.vocab_size, (B, prompt_len))
        slots = [1 + (b % slots_available) for b in range(B)]
        loop = StepLoop(layout, enc_run, dec_run, slots, bank)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loop.prefill(prompt)
        result = loop.replay()
        prefill_s = time.perf_counter() - t0
        tokens = result["logits"].argmax(-1)
        times = []
        for _ in range(decode_steps):
            t = time.perf_counter()
            tokens = loop.next_token(tokens)["logits"].argmax(-1)
            times.append(time.perf_counter() - t)
        step = statistics.median(times[1:] if len(times) > 2 else times)
        results[f"B{B}"] = {"step_ms": step * 1e3, "tokens_s": B / step, "prefill_s": prefill_s, "prompt": prompt_len}
    if device == "cuda":  # the same first decode step on CPU: how far the CUDA path is from the CPU reference path
        ec, dc, _ = steps("cpu")
        cpu_enc = runner(ec, layout.encoder_inputs(), layout.encoder_outputs(), "cpu")
        cpu_dec = runner(dc, layout.decoder_inputs(), layout.decoder_outputs(), "cpu")
        prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 64))
        diffs = {}
        for name, (run_e, run_d) in {"cuda": (enc_run, dec_run), "cpu": (cpu_enc, cpu_dec)}.items():
            check = StepLoop(layout, run_e, run_d, [1], bank)
            check.prefill(prompt)
            diffs[name] = check.replay()["logits"]
        results["logits_max_abs_diff_vs_cpu"] = float(np.abs(diffs["cuda"] - diffs["cpu"]).max())
        results["same_argmax_as_cpu"] = bool((diffs["cuda"].argmax(-1) == diffs["cpu"].argmax(-1)).all())
    return results


# ----------------------------------------------------------------------------------------------- report


def render(env: dict[str, Any], copy_bw: float, report: Report, model: dict[str, Any] | str | None,
           seconds: float) -> str:
    def ms(s: float | None) -> str:
        return "-" if s is None else f"{s * 1e3:.3f}"

    status = ("**FAILED: " + "; ".join(report.failures) + "**" if report.failures
              else "All kernels agree with their references.")
    lines = [SECTION, "",
             f"Written by `bash scripts/device_check.sh` on {env['date']}: {env['gpu']} (sm_{env['capability']}), "
             f"torch {env['torch']} (CUDA {env['cuda']}), OpenAI Triton {env['triton']}, Python {env['python']}; "
             f"{seconds:.0f} s in all.", "",
             status, "",
             f"Device-to-device copy bandwidth (1 GiB, read + write counted): **{copy_bw / 1e9:.0f} GB/s**. Kernel "
             "times are medians of CUDA-event timings with L2 flushed before each launch; GB/s counts the bytes the "
             "kernel must move (q, each batch row's distinct valid key rows, the index lists, the output), not what it "
             "actually loads.", "",
             "### Attention kernels (default configuration)", "",
             "| case | H x D, J | max error | ms | GB/s | of copy BW | TFLOP/s | torch reference ms | config "
             "(h/j/warps/stages) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report.rows:
        if r["kind"] == "attention":
            c = r["config"]
            lines.append(f"| {r['label']}{'' if r['ok'] else ' **MISMATCH**'} | {r['H']}x{r['D']}, {r['J']} | "
                         f"{r['max_error']:.2e} | {ms(r['seconds'])} | {r['gb_s']:.0f} | {r['of_copy']:.0%} | "
                         f"{r['tflops']:.1f} | {ms(r['reference_seconds'])} | "
                         f"{c['block_h']}/{c['block_j']}/{c['num_warps']}/{c['num_stages']} |")
    lines += ["", "### Launch configurations (SparseGlobalAttention, B = 64)", "",
              "| configuration h/j/warps/stages/fp32 dot | max error | ms | GB/s | of copy BW | TFLOP/s |",
              "|---|---|---|---|---|---|"]
    for r in report.rows:
        if r["kind"] == "sweep":
            if "error_text" in r:
                lines.append(f"| {r['label']} | {r['error_text']} | - | - | - | - |")
            else:
                mark = " (default)" if r.get("default") else ""
                lines.append(f"| {r['label']}{mark}{'' if r['ok'] else ' **MISMATCH**'} | {r['max_error']:.2e} | "
                             f"{ms(r['seconds'])} | {r['gb_s']:.0f} | {r['of_copy']:.0%} | {r['tflops']:.1f} |")
    lines += ["", "### PointerScore", "", "| case | max error | ms | GB/s | of copy BW | torch reference ms |",
              "|---|---|---|---|---|---|"]
    for r in report.rows:
        if r["kind"] == "pointer":
            lines.append(f"| {r['label']} (w={r['w']}, {r['heads']} heads, n={r['n']} x "
                         f"T={r['T']}){'' if r['ok'] else ' **MISMATCH**'} | {r['max_error']:.2e} | {ms(r['seconds'])} "
                         f"| {r['gb_s']:.0f} | {r['of_copy']:.0%} | {ms(r['reference_seconds'])} |")
    lines += ["", "### Ahead-of-time kernels (the TensorRT aot_impl's compile, launched with exactly the declared "
                  "arguments)", "",
              "| kernel | max error | PTX bytes | shared memory |", "|---|---|---|---|"]
    for r in report.rows:
        if r["kind"] in ("aot", "ptx"):
            err = f"{r['max_error']:.2e}" if "max_error" in r else "-"
            lines.append(f"| {r['label']}{'' if r.get('ok', True) else ' **MISMATCH**'} | {err} | {r['ptx_bytes']} | "
                         f"{r['shared']} |")
    lines += ["", "### The embedded model on the torch CUDA path", ""]
    if isinstance(model, dict):
        lines += ["EncoderStep + DecoderStep per decoded token (the engines' runtime loop with numpy state between "
                  "steps, rows on adapters 1..4), every mol2 op on its Triton kernel; prompt of "
                  f"{model['B1']['prompt']} tokens, then decode; median step time.", "",
                  "| batch | decode step ms | tokens/s | prefill + replay s |", "|---|---|---|---|"]
        for key in sorted((k for k in model if k.startswith("B")), key=lambda k: int(k[1:])):
            m = model[key]
            lines.append(f"| {key[1:]} | {m['step_ms']:.2f} | {m['tokens_s']:.0f} | {m['prefill_s']:.2f} |")
        if "logits_max_abs_diff_vs_cpu" in model:
            lines += ["", f"First decode step after a 64-token prompt, CUDA vs the CPU step modules: max |logits diff| "
                          f"{model['logits_max_abs_diff_vs_cpu']:.2e}, same argmax: {model['same_argmax_as_cpu']}."]
    else:
        lines.append(f"Not measured: {model}")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "kernels.md")
    p.add_argument("--json", type=Path, help="also write the raw results here")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-model", action="store_true", help="skip the whole-model timing")
    p.add_argument("--no-sweep", action="store_true", help="skip the launch-configuration sweep")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny shapes, kernels in Triton's interpreter; writes no docs")
    p.add_argument("--force", action="store_true",
                   help="overwrite the committed --out file (docs/kernels.md); scripts/device_check.sh passes it")
    args = p.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    ready = preflight(args.dry_run)
    if isinstance(ready, str):
        print(f"device_check: cannot run here: {ready}", file=sys.stderr)
        return 2
    torch, device = ready
    if not args.dry_run:
        from build_engines.committed import refuse_to_overwrite

        refuse_to_overwrite([args.out], args.force, "--out FILE, or --dry-run")
    import triton

    t_start = time.perf_counter()
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the references in exact fp32
        torch.backends.cudnn.allow_tf32 = False
    props = torch.cuda.get_device_properties(0) if device == "cuda" else None
    env = {"date": time.strftime("%Y-%m-%d %H:%M"), "gpu": props.name if props else "CPU (dry run)",
           "capability": "".join(map(str, torch.cuda.get_device_capability())) if props else "-",
           "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
           "python": platform.python_version()}
    print(f"device_check: {env}", flush=True)
    timer = Timer(torch, device, args.iters if not args.dry_run else 1)
    copy_bw = copy_bandwidth(torch, device, timer)
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    report = Report()
    stages: list[tuple[str, Callable[[], Any]]] = [
        ("attention", lambda: attention_cases(torch, device, report, timer, copy_bw, args.dry_run)),
        ("pointer", lambda: pointer_cases(torch, device, report, timer, copy_bw, args.dry_run)),
    ]
    if not args.no_sweep:
        stages.append(("sweep", lambda: sweep(torch, device, report, timer, copy_bw, args.dry_run)))
    if device == "cuda":
        stages.append(("aot", lambda: aot_cases(torch, device, report)))
    for name, stage in stages:
        t0 = time.perf_counter()
        try:
            stage()
        except Exception as exc:  # noqa: BLE001 - a crashed stage is a failure with its traceback
            report.failures.append(f"{name} stage crashed: {type(exc).__name__}: {exc}")
            report.notes.append(traceback.format_exc())
        print(f"stage {name}: {time.perf_counter() - t0:.1f} s, failures so far {len(report.failures)}", flush=True)
    model: dict[str, Any] | str | None = "skipped (--no-model)"
    if not args.no_model:
        t0 = time.perf_counter()
        try:
            model = model_throughput(torch, device, report, args.dry_run)
        except Exception as exc:  # noqa: BLE001
            # the model timing is informative; its failure does not fail the kernels
            model = f"the model run failed: {type(exc).__name__}: {exc}"
            report.notes.append(traceback.format_exc())
        print(f"stage model: {time.perf_counter() - t0:.1f} s", flush=True)
    text = render(env, copy_bw, report, model, time.perf_counter() - t_start)
    print(text)
    for note in report.notes:
        print(note, file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"env": env, "copy_bandwidth": copy_bw, "rows": report.rows,
                                         "failures": report.failures, "model": model}, indent=1, default=str))
    if not args.dry_run:
        from benchmarks.harness import write_section

        write_section(args.out, text, SECTION, title="# Kernels and TensorRT plugins of the mol2 ops")
        print(f"wrote the results into {args.out}")
    if report.failures:
        print("device_check: FAILED\n  " + "\n  ".join(report.failures), file=sys.stderr)
        return 1
    print("device_check: all kernels agree with their references")
    return 0


if __name__ == "__main__":
    sys.exit(main())
