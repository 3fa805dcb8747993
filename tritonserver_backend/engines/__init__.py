"""The engine interface the services call, and its three implementations.

`open_engine(backend, model_dir, engine_dir)` returns a `StepEngine` whose `encoder`, `decoder` and `pointer` run one
batched step on named numpy arrays (the contract in `ced.steps.layout`):

- `torch`: the step modules run by PyTorch (the reference; rows are run one at a time, because PyTorch's CPU matrix
  products round differently with the number of rows and a batch must not change any row's result);
- `onnx`: the ONNX graphs by onnxruntime (CPU here; the CUDA or TensorRT execution providers where installed);
- `trt`: TensorRT plans (guarded import; needs TensorRT and an NVIDIA GPU).
"""

from tritonserver_backend.engines.interface import BACKENDS, EngineUnavailable, StepEngine
from tritonserver_backend.engines.select import open_engine

__all__ = ["BACKENDS", "EngineUnavailable", "StepEngine", "open_engine"]
