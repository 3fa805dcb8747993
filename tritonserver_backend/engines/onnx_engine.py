"""The ONNX engines run by onnxruntime: CPU here, the CUDA or TensorRT execution providers where installed.

The adapter bank is bound once per change as OrtValues (IOBinding); a step binds only its own inputs. Every `mol2`
node runs as its local function (onnxruntime inlines it); no Python callback is involved. An engine built with
`--kv-quant fp8` takes and returns its rings and global-KV stores as fp8 e4m3: its `layout` makes the rows keep them
as uint8 codes, which are bound as FLOAT8E4M3FN OrtValues over the same memory (`quantize/kv_cache.py`).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ced.steps.kv_state import as_fp8, fp8_inputs, kv_layout
from tritonserver_backend.engines.interface import Arrays, EngineUnavailable, StepEngine, check_engine_dir


def session_options(threads: int, config: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    """`config`: session config entries the engine directory's manifest asks for (`quant.session_config`; release-format
    engines fold their weight dequantization at load).

    With more than one intra-op thread the pool's threads sleep between parallel sections instead of spinning
    (`MOL2_ORT_SPIN=1` restores onnxruntime's spinning): a Triton server runs several engine stubs side by side, and
    their spinning threads took the cores from each other; measured with `torch_threads` 2 on 2 cores
    (docs/load.md), spinning halved the served tokens/s and sleeping matched one thread."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    options.intra_op_num_threads = threads
    if threads > 1 and os.environ.get("MOL2_ORT_SPIN") != "1":
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return options


def providers() -> list[str]:
    """CUDA / TensorRT execution providers when this onnxruntime has them (onnxruntime-gpu), else the CPU one."""
    import onnxruntime as ort

    wanted = os.environ.get("MOL2_ORT_PROVIDERS")
    available = ort.get_available_providers()
    if wanted:
        chosen = [p for p in wanted.split(",") if p in available]
        if not chosen:
            raise EngineUnavailable(f"MOL2_ORT_PROVIDERS={wanted} but this onnxruntime offers {available}")
        return chosen
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


class OnnxEngine(StepEngine):
    backend = "onnx"

    def __init__(self, model_dir: Path, engine_dir: Path, threads: int | None = None) -> None:
        super().__init__(model_dir)
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise EngineUnavailable("the onnx engine needs onnxruntime (pip install onnxruntime)") from exc
        self.manifest = check_engine_dir(engine_dir, model_dir, "onnx")
        self.layout = kv_layout(self.cfg, self.manifest)  # fp8 rows for an fp8-KV engine
        self.engine_dir = engine_dir
        self.threads = threads or int(os.environ.get("MOL2_ORT_THREADS", "1"))
        self.providers = providers()
        self.sessions: dict[str, object] = {}
        self.inputs: dict[str, list[str]] = {}
        self.outputs: dict[str, list[str]] = {}
        self.fp8: dict[str, set[str]] = {}
        self._binding = None
        self._bank_names: set[str] = set()
        self._ort = ort

    def _session(self, name: str):  # type: ignore[no-untyped-def]
        """Opened on first use: the router process needs only the pointer graph."""
        if name not in self.sessions:
            path = self.engine_dir / self.manifest["graphs"][name]["file"]
            config = self.manifest.get("quant", {}).get("session_config")
            session = self._ort.InferenceSession(str(path), session_options(self.threads, config),
                                                 providers=self.providers)
            self.sessions[name] = session
            self.inputs[name] = [i.name for i in session.get_inputs()]
            self.outputs[name] = [o.name for o in session.get_outputs()]
            self.fp8[name] = fp8_inputs(session)
        return self.sessions[name]

    def describe(self) -> str:
        return f"onnx ({', '.join(self.providers)})"

    def _run(self, name: str, feed: Arrays) -> Arrays:
        session = self._session(name)
        fp8 = self.fp8[name]
        values = {k: as_fp8(self._ort, k, feed[k]) if k in fp8 else feed[k] for k in self.inputs[name]}
        return dict(zip(self.outputs[name], session.run(None, values)))

    def encoder(self, feed: Arrays) -> Arrays:
        return self._run("encoder", feed)

    def pointer(self, feed: Arrays) -> Arrays:
        return self._run("pointer", feed)

    def drafter(self, feed: Arrays) -> Arrays:
        if not self.has_drafter:
            return super().drafter(feed)
        return self._run("drafter", feed)

    def set_lora_bank(self, bank: Arrays) -> None:
        """Bind the bank's arrays once; steps only rebind their own inputs."""
        super().set_lora_bank(bank)
        session = self._session("decoder")
        missing = [n for n in self.inputs["decoder"] if n.startswith(("lora_a.", "lora_b.")) and n not in bank]
        if missing:
            raise ValueError(f"the adapter bank lacks decoder inputs {missing[:4]}")
        self._binding = session.io_binding()
        for name in self.inputs["decoder"]:
            if name in bank:
                self._binding.bind_ortvalue_input(
                    name, self._ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(bank[name])))
        self._bank_names = set(bank)

    def decoder(self, feed: Arrays) -> Arrays:
        if self._binding is None:
            raise RuntimeError("set_lora_bank() before the first decoder step")
        binding, fp8 = self._binding, self.fp8["decoder"]
        for name in self.inputs["decoder"]:
            if name in fp8:
                binding.bind_ortvalue_input(name, as_fp8(self._ort, name, feed[name]))
            elif name not in self._bank_names:
                binding.bind_cpu_input(name, np.ascontiguousarray(feed[name]))
        for name in self.outputs["decoder"]:
            binding.bind_output(name, "cpu")
        self._session("decoder").run_with_iobinding(binding)
        return dict(zip(self.outputs["decoder"], binding.copy_outputs_to_cpu()))
