"""The OpenAI Triton kernels of the three mol2 ops against their PyTorch references, on CPU, plus their AOT compile.

Triton's interpreter (TRITON_INTERPRET=1) is chosen when a `@triton.jit` function is created, and Triton's own
language helpers are created when `triton` is first imported, so the variable must be set before the first import
of triton in a process. Any earlier test (or plugin) may already have imported it here, so the checks run in a
worker subprocess started with the variable set (one per module, fed one check at a time with the test's fresh
seed); the worker proves interpreter mode is on (the kernels are `InterpretedFunction`s) before any check. The AOT
checks run in a second worker with the variable removed (compiling needs the real `JITFunction`).

Every check draws fresh random inputs from the seed, poisons the output buffer with NaN before the launch and checks
it was fully written, and covers masked (-1) indices, all-masked rows (exact zeros), the sink's effect, decode (S=1)
and prefill / replay (S > 1) shapes, non-power-of-two D, H and J, and bitwise batch / chunk invariance. Run with
`-s` to see each check's max error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
CHECKS: dict[str, Callable[[int], dict[str, Any]]] = {}


def check(fn: Callable[[int], dict[str, Any]]) -> Callable[[int], dict[str, Any]]:
    CHECKS[fn.__name__] = fn
    return fn


# ----------------------------------------------------------------------------------------------- inputs (worker side)


def _attention_case(seed: int, B: int, S: int, H: int, D: int, tables: tuple[int, ...], J: int, masked: float = 0.3,
                    dtype: Any = None) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.float32
    rows = sum(tables)
    idx = torch.randint(0, rows, (B, S, J), generator=g)
    idx[torch.rand(B, S, J, generator=g) < masked] = -1
    idx[0, 0] = -1  # a query that sees nothing: exact zeros
    return {
        "q": torch.randn(B, S, H, D, generator=g).to(dtype),
        "tables": [torch.randn(B, t, D, generator=g).to(dtype) for t in tables],
        "idx": idx,
        "sink": torch.randn(H, generator=g).to(dtype),
        "scale": D ** -0.5,
    }


def _poisoned(like: Any) -> Any:
    return torch.full(like.shape, float("nan"), dtype=like.dtype)


def _max_error(got: Any, want: Any) -> float:
    return float((got.double() - want.double()).abs().max()) if got.numel() else 0.0


def _sparse(case: dict[str, Any], config: Any = None) -> Any:
    from plugins.sparse_global_attention.kernel import launch

    out = _poisoned(case["q"])
    launch(case["q"], *case["tables"], case["idx"], case["sink"], case["scale"], out, config)
    assert not out.isnan().any(), "the kernel left part of its output unwritten"
    return out


def _sparse_ref(case: dict[str, Any]) -> Any:
    from plugins.sparse_global_attention.reference import sparse_global_attention_reference

    return sparse_global_attention_reference(case["q"], *case["tables"], case["idx"], case["sink"], case["scale"])


def _swa(case: dict[str, Any], config: Any = None) -> Any:
    from plugins.swa_replay_attention.kernel import launch

    out = _poisoned(case["q"])
    launch(case["q"], case["tables"][0], case["idx"], case["sink"], case["scale"], out, config)
    assert not out.isnan().any(), "the kernel left part of its output unwritten"
    return out


def _swa_ref(case: dict[str, Any]) -> Any:
    from plugins.swa_replay_attention.reference import swa_replay_attention_reference

    return swa_replay_attention_reference(case["q"], case["tables"][0], case["idx"], case["sink"], case["scale"])


def _common_attention_checks(case: dict[str, Any], run: Callable[..., Any], ref: Callable[..., Any],
                             tol: float = TOL) -> dict[str, Any]:
    """Matches the reference; all-masked queries are exact zeros; the sink changes exactly the heads it belongs to."""
    got, want = run(case), ref(case)
    err = _max_error(got, want)
    assert err < tol, f"max error {err:.3g} vs the reference"
    dead = (case["idx"] < 0).all(-1)  # (B, S) queries with no valid key
    assert dead.any() and torch.equal(got[dead], torch.zeros_like(got[dead])), (
        "an all-masked query must give exact zeros")
    sink2 = case["sink"].clone()
    sink2[1 % sink2.numel()] += 2.0
    moved = run({**case, "sink": sink2})
    live = ~dead
    head = 1 % sink2.numel()
    assert (moved[live][:, head] - got[live][:, head]).abs().max() > 1e-4, (
        "raising a head's sink must change its output")
    others = [h for h in range(sink2.numel()) if h != head]
    assert torch.equal(moved[:, :, others], got[:, :, others]), "a head's sink must not touch the other heads"
    err2 = _max_error(moved, ref({**case, "sink": sink2}))
    assert err2 < tol, f"max error {err2:.3g} vs the reference with the changed sink"
    return {"max_error": max(err, err2), "masked_fraction": float((case["idx"] < 0).float().mean())}


# ----------------------------------------------------------------------------------------------- checks


@check
def sparse_decode(seed: int) -> dict[str, Any]:
    """S = 1 with both tables, D and H not powers of two, J = 21 over several blocks of a small config."""
    from plugins.sparse_global_attention.kernel import Config

    case = _attention_case(seed, B=3, S=1, H=5, D=20, tables=(9, 37), J=21)
    out = _common_attention_checks(case, _sparse, _sparse_ref)
    local = (case["idx"] >= 0) & (case["idx"] < 9)
    assert local.any() and (case["idx"] >= 9).any(), "both tables were read"
    small = Config(block_h=16, block_j=16, block_d=32, num_warps=4, num_stages=1)  # J spans two blocks
    err = _max_error(_sparse(case, small), _sparse_ref(case))
    assert err < TOL, f"max error {err:.3g} with 16-row blocks"
    return {**out, "max_error": max(out["max_error"], err)}


@check
def sparse_prefill(seed: int) -> dict[str, Any]:
    """S = 6 (a prefill chunk), H = 20 over two head blocks, J = 40 over three blocks, out-of-range rows clamped."""
    from plugins.sparse_global_attention.kernel import Config

    case = _attention_case(seed, B=2, S=6, H=20, D=48, tables=(14, 23), J=40)
    case["idx"][1, 2, :3] = 14 + 23 + 5  # past the last row: the reference clamps to the last global row
    out = _common_attention_checks(case, _sparse, _sparse_ref)
    split = Config(block_h=16, block_j=16, block_d=64, num_warps=4, num_stages=2)
    err = _max_error(_sparse(case, split), _sparse_ref(case))
    assert err < TOL, f"max error {err:.3g} with two head blocks"
    return {**out, "max_error": max(out["max_error"], err)}


@check
def sparse_invariance(seed: int) -> dict[str, Any]:
    """A query's output is bit-identical alone, in a batch, and in any chunking of its sequence."""
    case = _attention_case(seed, B=3, S=4, H=4, D=16, tables=(10, 30), J=18)
    full = _sparse(case)
    for b in range(3):
        alone = {**case, "q": case["q"][b:b + 1], "tables": [t[b:b + 1] for t in case["tables"]],
                 "idx": case["idx"][b:b + 1]}
        assert torch.equal(_sparse(alone), full[b:b + 1]), f"row {b} differs alone and in the batch"
    for s0, s1 in ((0, 1), (1, 3), (3, 4)):
        chunk = {**case, "q": case["q"][:, s0:s1], "idx": case["idx"][:, s0:s1]}
        assert torch.equal(_sparse(chunk), full[:, s0:s1]), f"positions {s0}:{s1} differ as a chunk"
    return {"max_error": _max_error(full, _sparse_ref(case))}


@check
def sparse_fp16(seed: int) -> dict[str, Any]:
    """fp16 tables: tensor-core dots with fp32 accumulation, within about one fp16 ulp of the fp32-math reference.
    (bf16 takes the same path; Triton's interpreter computes bf16 dots wrongly, so bf16 is checked on a GPU only.)"""
    case = _attention_case(seed, B=2, S=3, H=4, D=32, tables=(8, 24), J=20, dtype=torch.float16)
    got, want = _sparse(case), _sparse_ref(case)
    err = _max_error(got, want)
    assert got.dtype == torch.float16 and err < 4e-3, f"max error {err:.3g} (fp16)"
    dead = (case["idx"] < 0).all(-1)
    assert torch.equal(got[dead].float(), torch.zeros_like(got[dead]).float())
    return {"max_error": err}


@check
def swa_decode(seed: int) -> dict[str, Any]:
    """SwaReplayAttention at S = 1: ring + one new row, window W = 8 (one row masked at random, one query empty)."""
    case = _attention_case(seed, B=3, S=1, H=6, D=24, tables=(9,), J=8)
    return _common_attention_checks(case, _swa, _swa_ref)


@check
def swa_replay(seed: int) -> dict[str, Any]:
    """A replay: S = 12 rows, front-padded inert rows (all -1) first, W = 10, H = 20 over two head blocks."""
    from plugins.sparse_global_attention.kernel import Config

    case = _attention_case(seed, B=2, S=12, H=20, D=40, tables=(22,), J=10, masked=0.1)
    case["idx"][1, :3] = -1  # three padding rows in front of row 1's replay
    out = _common_attention_checks(case, _swa, _swa_ref)
    got = _swa(case, Config(block_h=16, block_j=16, block_d=64, num_warps=4, num_stages=1))
    err = _max_error(got, _swa_ref(case))
    assert err < TOL and torch.equal(got[1, :3], torch.zeros_like(got[1, :3]))
    full = _swa(case)
    alone = {**case, "q": case["q"][1:], "tables": [case["tables"][0][1:]], "idx": case["idx"][1:]}
    assert torch.equal(_swa(alone), full[1:]), "a row's replay differs alone and in the batch"
    return {**out, "max_error": max(out["max_error"], err)}


def _pointer_case(seed: int, B: int, w: int, heads: int, n: int, T: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    L = n * T
    attn_bias = torch.randn(heads * L, generator=g)
    pad = torch.rand(heads, n, T, generator=g) < 0.3
    pad[:, :, 0] = False  # every option keeps at least its first token
    attn_bias.view(heads, n, T)[pad] = float("-inf")  # option padding, as OptionCache folds it
    mask = torch.rand(B, n, generator=g) < 0.6
    mask[0] = False  # a row with no candidate: -inf everywhere
    mask[1 % B] = True
    return {
        "x": torch.randn(B, w, generator=g), "xn": torch.randn(B, w, generator=g),
        "attn_query": torch.randn(w, heads * L, generator=g) * 0.3, "attn_bias": attn_bias,
        "point_query": torch.randn(w, n, generator=g), "point_read": torch.randn(heads * L, n, generator=g),
        "point_bias": torch.randn(n, generator=g), "option_mask": mask, "heads": heads,
    }


def _pointer(case: dict[str, Any], fused: bool) -> Any:
    from plugins.pointer_score.kernel import launch

    args = [case[k] for k in ("x", "xn", "attn_query", "attn_bias", "point_query", "point_read", "point_bias",
                              "option_mask")]
    out = torch.full(case["option_mask"].shape, float("nan"))
    launch(*args, case["heads"], out, fused=fused)
    assert not out.isnan().any(), "the kernel left part of its output unwritten (or computed NaN)"
    return out


def _pointer_checks(case: dict[str, Any]) -> dict[str, Any]:
    from plugins.pointer_score.reference import pointer_score_reference

    want = pointer_score_reference(*[case[k] for k in ("x", "xn", "attn_query", "attn_bias", "point_query",
                                                       "point_read", "point_bias", "option_mask")], case["heads"])
    errors = {}
    for fused in (False, True):
        got = _pointer(case, fused)
        assert torch.equal(torch.isinf(got), ~case["option_mask"]), "-inf exactly outside the candidate set"
        assert torch.equal(torch.isinf(want), torch.isinf(got))
        fin = torch.isfinite(want)
        err = _max_error(got[fin], want[fin])
        scale = max(1.0, float(want[fin].abs().max()))
        assert err < TOL * scale, f"max error {err:.3g} (fused={fused}) against logits up to {scale:.3g}"
        errors["fused" if fused else "two_kernels"] = err
        B = got.shape[0]
        last = {k: (v[B - 1:] if k in ("x", "xn", "option_mask") else v) for k, v in case.items()}
        assert torch.equal(_pointer(last, fused), got[B - 1:]), "a row's logits differ alone and in the batch"
    return {"max_error": max(errors.values()), **errors}


@check
def pointer_small(seed: int) -> dict[str, Any]:
    """B = 5 rows (one without candidates), w = 24, 3 heads, n = 5 options of T = 3 tokens (some padded)."""
    return _pointer_checks(_pointer_case(seed, B=5, w=24, heads=3, n=5, T=3))


@check
def pointer_blocks(seed: int) -> dict[str, Any]:
    """B = 18 (two row blocks), w = 70 (three w blocks), n = 20 > 16 options, L = 100 over two L blocks per head."""
    return _pointer_checks(_pointer_case(seed, B=18, w=70, heads=2, n=20, T=5))


# ----------------------------------------------------------------------------------------------- AOT checks


def _aot(module: str, **spec: Any) -> dict[str, Any]:
    import importlib
    import re

    trt = importlib.import_module(module)
    t0 = time.perf_counter()
    kernel = trt.compile_kernel((90, 32), **spec)
    seconds = time.perf_counter() - t0
    ptx = kernel.ptx
    assert re.search(r"^\.version \d+\.\d+", ptx, re.M), "PTX without a .version line"
    assert re.search(r"^\.target sm_90", ptx, re.M), "PTX not for sm_90"
    entry = re.search(r"\.entry\s+(\w+)\s*\(", ptx)
    assert entry and entry.group(1) == kernel.name, f"kernel entry {kernel.name} missing from the PTX"
    assert 0 < kernel.shared <= 227 * 1024, f"{kernel.shared} bytes of shared memory does not fit sm_90"
    version = re.search(r"^\.version (\S+)", ptx, re.M).group(1)  # type: ignore[union-attr]
    return {"name": kernel.name, "ptx_bytes": len(ptx), "ptx_version": version, "shared": kernel.shared,
            "num_warps": kernel.num_warps, "seconds": round(seconds, 2)}


@check
def aot_sparse(seed: int) -> dict[str, Any]:
    return {dt: _aot("plugins.sparse_global_attention.trt", dtype=dt) for dt in ("fp32", "bf16")}


@check
def aot_swa(seed: int) -> dict[str, Any]:
    return {dt: _aot("plugins.swa_replay_attention.trt", dtype=dt) for dt in ("fp32", "fp16")}


@check
def aot_pointer(seed: int) -> dict[str, Any]:
    return {"n64": _aot("plugins.pointer_score.trt", options=64)}


# ----------------------------------------------------------------------------------------------- worker process


def worker() -> None:
    """Answer one JSON request per stdin line ({"check", "seed"}) with one JSON line on the real stdout."""
    import warnings

    warnings.filterwarnings("ignore")
    reply = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr  # anything printed by the code under test stays off the protocol channel
    from triton.runtime.interpreter import InterpretedFunction

    import plugins.pointer_score.kernel as pk
    import plugins.sparse_global_attention.kernel as sk
    import plugins.swa_replay_attention.kernel as wk

    kernels = (sk.sparse_global_attention_kernel, wk.swa_replay_attention_kernel, pk.pointer_logits_kernel,
               pk.pointer_scores_kernel)
    import triton

    hello = {"interpreted": all(isinstance(k, InterpretedFunction) for k in kernels), "triton": triton.__version__}
    reply.write(json.dumps(hello) + "\n")
    reply.flush()
    for line in sys.stdin:
        request = json.loads(line)
        t0 = time.perf_counter()
        try:
            result = {"ok": True, "result": CHECKS[request["check"]](int(request["seed"]))}
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            result = {"ok": False, "error": traceback.format_exc()}
        result["seconds"] = round(time.perf_counter() - t0, 3)
        reply.write(json.dumps(result) + "\n")
        reply.flush()


class Worker:
    def __init__(self, interpret: bool) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        if interpret:
            env["TRITON_INTERPRET"] = "1"
        self.cache = tempfile.TemporaryDirectory(prefix="triton-cache-")
        env["TRITON_CACHE_DIR"] = self.cache.name  # cold compiles, and nothing left in the user's ~/.triton
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.plugins.test_kernels", "--worker"], cwd=ROOT,
                                     env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"the kernel worker did not start:\n{self.proc.stderr.read()}")  # type: ignore[union-attr]
        self.hello = json.loads(line)

    def run(self, name: str, seed: int) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"check": name, "seed": seed}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"the kernel worker died:\n{self.proc.stderr.read()}")  # type: ignore[union-attr]
        answer = json.loads(line)
        if not answer["ok"]:
            pytest.fail(f"{name} (seed {seed}) failed in the worker:\n{answer['error']}")
        print(f"{name}: {json.dumps(answer['result'])} ({answer['seconds']} s)")
        return answer["result"]

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.cache.cleanup()


@pytest.fixture(scope="module")
def interpreter():  # type: ignore[no-untyped-def]
    import triton  # noqa: F401 - the dev extra installs it (Linux): a missing or broken install must fail, not skip

    w = Worker(interpret=True)
    yield w
    w.close()


@pytest.fixture(scope="module")
def compiler():  # type: ignore[no-untyped-def]
    import triton  # noqa: F401 - the dev extra installs it (Linux): a missing or broken install must fail, not skip

    w = Worker(interpret=False)
    yield w
    w.close()


# ----------------------------------------------------------------------------------------------- tests


def test_worker_runs_the_interpreter(interpreter: Worker) -> None:
    assert interpreter.hello["interpreted"], "TRITON_INTERPRET=1 did not give interpreted kernels in the worker"


@pytest.mark.parametrize("name", [n for n in CHECKS if not n.startswith("aot_")])
def test_kernel_matches_reference(interpreter: Worker, name: str, seed: int) -> None:
    result = interpreter.run(name, seed)
    assert result["max_error"] < (4e-3 if name.endswith("fp16") else 1e-4)


@pytest.mark.parametrize("name", [n for n in CHECKS if n.startswith("aot_")])
def test_aot_compiles_to_sm90_ptx(compiler: Worker, name: str, seed: int) -> None:
    assert not compiler.hello["interpreted"]
    for spec in compiler.run(name, seed).values():
        assert spec["ptx_bytes"] > 10_000


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: the torch.library ops run the reference on CPU")
def test_ops_on_cuda_run_the_kernels(seed: int) -> None:
    """torch.ops.mol2.* on CUDA tensors (op.py routes them to the Triton kernels) equal the references."""
    import triton  # noqa: F401 - installed by the dev extra; without it the CUDA ops would test the reference

    from plugins.pointer_score import pointer_score
    from plugins.pointer_score.kernel import pointer_score_triton
    from plugins.pointer_score.reference import pointer_score_reference
    from plugins.sparse_global_attention import sparse_global_attention
    from plugins.sparse_global_attention.kernel import sparse_global_attention_triton
    from plugins.swa_replay_attention import swa_replay_attention
    from plugins.swa_replay_attention.kernel import swa_replay_attention_triton

    cuda = torch.device("cuda")
    case = _attention_case(seed, B=4, S=3, H=8, D=64, tables=(40, 300), J=96)
    on = {k: ([t.to(cuda) for t in v] if k == "tables" else (v.to(cuda) if isinstance(v, torch.Tensor) else v))
          for k, v in case.items()}
    got = sparse_global_attention(on["q"], *on["tables"], on["idx"], on["sink"], on["scale"])
    assert torch.equal(got, sparse_global_attention_triton(on["q"], *on["tables"], on["idx"], on["sink"], on["scale"]))
    assert _max_error(got.cpu(), _sparse_ref(case)) < TOL
    got = swa_replay_attention(on["q"], on["tables"][0], on["idx"].clamp(max=39), on["sink"], on["scale"])
    assert torch.equal(got, swa_replay_attention_triton(on["q"], on["tables"][0], on["idx"].clamp(max=39), on["sink"],
                                                        on["scale"]))
    assert _max_error(got.cpu(), _swa_ref({**case, "idx": case["idx"].clamp(max=39)})) < TOL
    p = _pointer_case(seed, B=6, w=40, heads=4, n=7, T=4)
    names = ("x", "xn", "attn_query", "attn_bias", "point_query", "point_read", "point_bias", "option_mask")
    args = [p[k].to(cuda) for k in names]
    got = pointer_score(*args, p["heads"])
    assert torch.equal(got, pointer_score_triton(*args, p["heads"]))
    want = pointer_score_reference(*[p[k] for k in names], p["heads"])
    fin = torch.isfinite(want)
    assert torch.equal(torch.isinf(got.cpu()), torch.isinf(want)) and _max_error(got.cpu()[fin], want[fin]) < TOL * 10


if __name__ == "__main__" and "--worker" in sys.argv:
    worker()
