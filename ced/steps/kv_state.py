"""The engines' fp8 state at run time: the layout an engine directory's manifest asks for, its per-tensor scales, and
feeding onnxruntime fp8 inputs (uint8 codes wrapped as FLOAT8E4M3FN values, no copy).

The build half (calibrating the scales, rewriting the graphs) is build_engines/quantize/kv_cache.py; this half is what
a serving engine needs, so it lives below both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from onnx import TensorProto

from ced.model.dspark_spec import DSparkSpec
from ced.steps.layout import StepLayout
from ced.steps.rows import KVFormat, KVStateLayout

FP8_TYPE = "tensor(float8e4m3fn)"
Arrays = dict[str, np.ndarray]


@dataclass(frozen=True)
class KVScales:
    """Per-tensor fp8 scales of the state (amax / 448)."""

    encoder_rings: tuple[float, ...]
    decoder_rings: tuple[float, ...]
    stores: dict[int, float]
    handover_source: int  # layer E: the store the hand-over's global_kv feeds (and the decoder's mirror)

    def describe(self) -> dict[str, Any]:
        return {"encoder_rings": list(self.encoder_rings), "decoder_rings": list(self.decoder_rings),
                "stores": {str(s): v for s, v in self.stores.items()}, "handover_source": self.handover_source}

    @classmethod
    def from_manifest(cls, kv: dict[str, Any]) -> "KVScales":
        scales = kv["scales"]
        return cls(tuple(scales["encoder_rings"]), tuple(scales["decoder_rings"]),
                   {int(s): v for s, v in scales["stores"].items()},
                   int(scales["handover_source"]))

    def format(self) -> KVFormat:
        return KVFormat(self.stores[self.handover_source])


def kv_layout(cfg, manifest: dict[str, Any] | None) -> StepLayout:  # type: ignore[no-untyped-def]
    """The rows' layout for an engine directory: fp8 state when its manifest says `quant.kv_cache`, else fp32."""
    kv = (manifest or {}).get("quant", {}).get("kv_cache")
    layout = KVStateLayout(cfg, KVScales.from_manifest(kv).format()) if kv else StepLayout(cfg)
    # the build's DSpark drafter (graph `drafter`, decoder output `draft_main`)
    drafter = (manifest or {}).get("drafter")
    layout.drafter = DSparkSpec.from_release(cfg, drafter) if drafter else None
    return layout


def fp8_inputs(session: Any) -> set[str]:
    """Names of a session's FLOAT8E4M3FN inputs (fed as uint8 codes)."""
    return {i.name for i in session.get_inputs() if i.type == FP8_TYPE}


def as_fp8(ort: Any, name: str, array: np.ndarray) -> Any:
    """uint8 codes -> a FLOAT8E4M3FN OrtValue over the same memory (no copy)."""
    if array.dtype != np.uint8:
        raise TypeError(f"{name}: an fp8-state engine takes uint8 fp8 codes, got {array.dtype} "
                        "(rows made with a fp32 layout? open the engine's layout with kv_layout)")
    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(array), TensorProto.FLOAT8E4M3FN)


def session_runner(session: Any) -> Callable[[Arrays], Arrays]:
    """feed -> outputs for any session: fp8 inputs wrapped as OrtValues, fp8 outputs come back as uint8 arrays."""
    import onnxruntime as ort

    names = [o.name for o in session.get_outputs()]
    inputs = [i.name for i in session.get_inputs()]
    fp8 = fp8_inputs(session)

    def run(feed: Arrays) -> Arrays:
        values = {n: as_fp8(ort, n, feed[n]) if n in fp8 else feed[n] for n in inputs}
        return dict(zip(names, session.run(None, values)))

    return run


def kv_runner(path: Path, config: dict[str, str] | None = None) -> Callable[[Arrays], Arrays]:
    """`onnx_build.ort_runner` for any engine graph (fp8 state or not), with optional session config entries."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    return session_runner(ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]))
