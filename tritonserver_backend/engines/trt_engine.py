"""TensorRT plans run by the TensorRT runtime on an NVIDIA GPU (guarded: import only where TensorRT exists).

Each plan has one optimization profile per step shape (see build_engines/build/trt_build.py); a step picks the
profile whose S range holds its length, sets the input shapes, binds torch CUDA tensors as device memory and runs
`execute_async_v3` on a CUDA stream. Inputs and outputs cross as numpy arrays, so the services need not know which
engine they use; the mol2 plugins are registered before the plans are deserialized.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ced.steps.kv_state import kv_layout
from ced.steps.layout import SPEC_BLOCK
from plugins.tensorrt_support import TensorRTUnavailable, require_tensorrt_plugin
from tritonserver_backend.engines.interface import Arrays, EngineUnavailable, StepEngine, check_engine_dir

PROFILES = {"encoder": {"prefill": None, "decode": 1}, "decoder": {"replay": None, "decode": 1},
            "pointer": {"route": None}, "drafter": {"draft": None}}
DECODE_STEPS = {"encoder": 2, "decoder": SPEC_BLOCK}  # the longest step each graph's decode profile takes (trt_build)


class TrtEngine(StepEngine):
    backend = "trt"

    def __init__(self, model_dir: Path, engine_dir: Path) -> None:
        super().__init__(model_dir)
        try:
            require_tensorrt_plugin()
        except TensorRTUnavailable as exc:
            raise EngineUnavailable(str(exc)) from None
        import tensorrt as trt
        import torch

        from plugins import register_all

        if not torch.cuda.is_available():
            raise EngineUnavailable("the trt engine needs an NVIDIA GPU (torch.cuda.is_available() is False)")
        register_all()
        self.manifest = check_engine_dir(engine_dir, model_dir, "trt")
        self.layout = kv_layout(self.cfg, self.manifest)  # with the build's drafter, when it has one
        self._trt, self._torch = trt, torch
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engines, self.contexts = {}, {}
        for name, graph in self.manifest["graphs"].items():
            engine = runtime.deserialize_cuda_engine((engine_dir / graph["file"]).read_bytes())
            if engine is None:
                raise EngineUnavailable(f"TensorRT could not deserialize {graph['file']} (built for another GPU or "
                                        "TensorRT version?)")
            self.engines[name] = engine
            self.contexts[name] = engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        self._bank_device: dict[str, object] = {}

    def set_lora_bank(self, bank: Arrays) -> None:
        super().set_lora_bank(bank)
        self._bank_device = {k: self._torch.from_numpy(np.ascontiguousarray(v)).cuda() for k, v in bank.items()}

    def _profile(self, graph: str, feed: Arrays) -> int:
        names = list(PROFILES[graph])
        if len(names) == 1:
            return 0
        steps = next(v.shape[1] for k, v in feed.items() if k in ("tokens", "streams"))
        return names.index("decode") if steps <= DECODE_STEPS[graph] else 0

    def _run(self, graph: str, feed: Arrays, device_inputs: dict[str, object] | None = None) -> Arrays:
        trt, torch = self._trt, self._torch
        engine, context = self.engines[graph], self.contexts[graph]
        context.set_optimization_profile_async(self._profile(graph, feed), self.stream.cuda_stream)
        keep, outputs = [], {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            if engine.get_tensor_mode(name) != trt.TensorIOMode.INPUT:
                continue
            tensor = (device_inputs or {}).get(name)
            if tensor is None:
                tensor = torch.from_numpy(np.ascontiguousarray(feed[name])).cuda(non_blocking=True)
            keep.append(tensor)
            context.set_input_shape(name, tuple(tensor.shape))
            context.set_tensor_address(name, tensor.data_ptr())
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            if engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT:
                shape = tuple(context.get_tensor_shape(name))
                dtype = torch.int64 if engine.get_tensor_dtype(name) == trt.int64 else torch.float32
                outputs[name] = torch.empty(shape, dtype=dtype, device="cuda")
                context.set_tensor_address(name, outputs[name].data_ptr())
        if not context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError(f"TensorRT failed to run the {graph} plan")
        self.stream.synchronize()
        return {k: v.cpu().numpy() for k, v in outputs.items()}

    def encoder(self, feed: Arrays) -> Arrays:
        return self._run("encoder", feed)

    def decoder(self, feed: Arrays) -> Arrays:
        return self._run("decoder", feed, self._bank_device)

    def pointer(self, feed: Arrays) -> Arrays:
        return self._run("pointer", feed)

    def drafter(self, feed: Arrays) -> Arrays:
        if not self.has_drafter:
            return super().drafter(feed)
        return self._run("drafter", feed)
