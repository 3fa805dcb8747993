"""How many GPUs one serving pod asks for, from the memory planner (`python -m build_engines plan`).

    python -m deploy.sizing --preset deepseek-v4.1-flash --gpu-memory-gib 140 --sessions 32 --context 131072
    python -m deploy.sizing ... --write deploy/k8s/overlays/gpu-tp/sizing.json

A tensor-parallel group shares one model copy over NVLink, so it is one pod with N GPUs (never N pods): N is the
smallest power of two (tensor-parallel sizes divide the head counts) whose usable memory holds

    weights (the planner's bytes in the stored format)
    + sessions x (2 x context x global-KV bytes per token + SWA ring bytes per session)

The global KV is counted twice because both session stores hold it (the encoder's state and the decoder's mirror,
docs/serving.md "Sessions"); the rings are counted once (the decoder keeps the rings of the adapter that answered
last). ``usable_fraction`` leaves room for activations, the CUDA context and allocator slack.

The planner takes tens of seconds (it builds the preset's network on the meta device), so its figures are kept in the
overlay's sizing.json; the fast test recomputes N from them, a slow test re-runs the planner and checks they are
current.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

GIB = 1 << 30
WEIGHT_FORMATS = ("release", "bf16", "fp32")  # release: the stored fp8/fp4 formats; fp32: the ONNX engines here


@dataclass(frozen=True)
class SizingInputs:
    preset: str
    weights: str  # one of WEIGHT_FORMATS
    gpu: str  # what the GPU is, for people (e.g. "H200 141 GB")
    gpu_memory_gib: float  # what nvidia-smi reports as total, in GiB
    sessions: int  # sessions held at once (the session stores' budget must hold them)
    context: int  # tokens per session
    usable_fraction: float = 0.9


@dataclass(frozen=True)
class PlannerFigures:
    """What the sizing reads from the planner (ced/plan.py MemoryPlan)."""

    weight_bytes: int
    global_kv_bytes_per_token: float
    swa_ring_bytes_per_session: int


def planner_figures(preset: str, weights: str) -> PlannerFigures:
    """Run the memory planner for ``preset`` (slow: imports torch, builds the network on the meta device)."""
    from ced.model.config import get_preset
    from ced.plan import plan

    p = plan(get_preset(preset))
    weight_bytes = {"release": p.weight_bytes_release, "bf16": p.weight_bytes_bf16, "fp32": 4 * p.params_total}[weights]
    return PlannerFigures(weight_bytes, p.global_kv_bytes_per_token, p.swa_ring_bytes_per_session)


def bytes_needed(inputs: SizingInputs, figures: PlannerFigures) -> float:
    per_session = 2 * inputs.context * figures.global_kv_bytes_per_token + figures.swa_ring_bytes_per_session
    return figures.weight_bytes + inputs.sessions * per_session


def gpus_needed(inputs: SizingInputs, figures: PlannerFigures) -> int:
    """The smallest power of two of GPUs whose usable memory holds :func:`bytes_needed`."""
    usable = inputs.gpu_memory_gib * GIB * inputs.usable_fraction
    n = max(1, math.ceil(bytes_needed(inputs, figures) / usable))
    return 1 << (n - 1).bit_length()


def sizing_record(inputs: SizingInputs, figures: PlannerFigures) -> dict:
    """What an overlay's sizing.json holds: the inputs, the planner's figures and the answer."""
    return {
        "inputs": asdict(inputs),
        "planner": asdict(figures),
        "bytes_needed": bytes_needed(inputs, figures),
        "gpus": gpus_needed(inputs, figures),
    }


def read_record(path: Path) -> tuple[SizingInputs, PlannerFigures, int]:
    data = json.loads(Path(path).read_text())
    return SizingInputs(**data["inputs"]), PlannerFigures(**data["planner"]), int(data["gpus"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="deepseek-v4.1-flash")
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="release")
    parser.add_argument("--gpu", default="H200 141 GB")
    parser.add_argument("--gpu-memory-gib", type=float, default=140.0)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--usable-fraction", type=float, default=0.9)
    parser.add_argument("--write", type=Path, help="write the record to this sizing.json")
    a = parser.parse_args(argv)
    inputs = SizingInputs(a.preset, a.weights, a.gpu, a.gpu_memory_gib, a.sessions, a.context, a.usable_fraction)
    record = sizing_record(inputs, planner_figures(a.preset, a.weights))
    text = json.dumps(record, indent=2) + "\n"
    if a.write:
        a.write.write_text(text)
    print(text, end="")
    print(
        f"nvidia.com/gpu: {record['gpus']} ({record['bytes_needed'] / 1e9:.1f} GB needed, "
        f"{a.gpu_memory_gib * a.usable_fraction:.0f} GiB usable per {a.gpu})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
