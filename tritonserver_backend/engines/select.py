"""`open_engine`: the selector. It sits above the implementations, which import only `interface`, so the package has
no import cycle."""

from __future__ import annotations

from pathlib import Path

from tritonserver_backend.engines.interface import BACKENDS, EngineUnavailable, StepEngine


def open_engine(backend: str, model_dir: str | Path, engine_dir: str | Path | None = None,
                tensor_parallel_size: int = 1, expert_parallel: bool = False, threads: int = 1) -> StepEngine:
    """The engine of `backend` for the checkpoint in `model_dir` (`engine_dir` holds the onnx graphs or trt plans).
    `tensor_parallel_size` > 1 runs the encoder and the decoder each on that many ranks (`expert_parallel`: routed
    experts placed whole), on the torch engine (docs/parallel.md says why)."""
    if tensor_parallel_size < 1:
        raise EngineUnavailable(f"tensor_parallel_size must be at least 1, got {tensor_parallel_size}")
    if tensor_parallel_size > 1 or expert_parallel:
        if backend != "torch":
            raise EngineUnavailable(f"tensor_parallel_size {tensor_parallel_size} runs on the torch engine, not "
                                    f"{backend!r}: onnxruntime has no collective op (docs/parallel.md); use "
                                    "engine_backend torch")
        if tensor_parallel_size == 1:
            raise EngineUnavailable("expert parallelism places experts over the tensor-parallel ranks: it needs "
                                    "tensor_parallel_size of at least 2")
        from tritonserver_backend.engines.parallel_engine import ParallelTorchEngine

        return ParallelTorchEngine(Path(model_dir), tensor_parallel_size, expert_parallel, threads,
                                   Path(engine_dir) if engine_dir is not None else None)
    if backend == "torch":
        from tritonserver_backend.engines.torch_engine import TorchEngine

        return TorchEngine(Path(model_dir))
    if backend not in BACKENDS:
        raise EngineUnavailable(f"unknown engine backend {backend!r}; choose one of {list(BACKENDS)}")
    if engine_dir is None:
        raise EngineUnavailable(f"the {backend} engine needs an engine directory (build one with `python -m "
                                "build_engines build`)")
    if backend == "onnx":
        from tritonserver_backend.engines.onnx_engine import OnnxEngine

        return OnnxEngine(Path(model_dir), Path(engine_dir))
    from tritonserver_backend.engines.trt_engine import TrtEngine

    return TrtEngine(Path(model_dir), Path(engine_dir))
