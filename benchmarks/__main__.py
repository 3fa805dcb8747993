"""`python -m benchmarks NAME [ARGS]`: every benchmark and study behind one command (`--help` after a name shows its
options). Each writes its figures into `docs/` (`--force` to overwrite the committed ones) and prints them."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "switch": ("switch", "switch cost vs context: bounded replay vs full hand-off (docs/benchmarks.md)"),
    "session-memory": ("session_memory", "session memory vs adapters (docs/benchmarks.md)"),
    "routing-latency": ("routing_latency", "routing placement and latency (docs/routing_latency.md)"),
    "routing-serving": ("routing_serving", "routing through a served model under load (docs/load.md)"),
    "prefix-cache": ("prefix_cache", "time to first token with the prefix cache: cold vs hit (docs/prefix_cache.md)"),
    "chunked-prefill": ("chunked_prefill", "streams while a long prompt is prefilled: whole vs chunked (docs/load.md)"),
    "prefix-storm": ("prefix_storm", "distinct long prefixes under small budgets: resident memory within the budgets "
                     "(docs/prefix_cache.md)"),
    "prefix-state-bytes": ("prefix_state_bytes", "encoder state bytes of sessions on one prompt, cache vs none "
                           "(docs/prefix_cache.md)"),
    "engines": ("engines", "torch vs onnx engines side by side (docs/engines.md)"),
    "serving": ("serving", "concurrent sessions through tritonserver (docs/load.md)"),
    "speculative": ("speculative", "DSpark and prompt lookup vs plain decoding (docs/speculative.md)"),
    "speculative-dynamo": ("speculative_dynamo", "DSpark and prompt lookup vs plain decoding through a Dynamo "
                           "deployment, single rank and TP (docs/speculative.md)"),
    "openai": ("openai_load", "the OpenAI frontend under load (docs/openai.md)"),
    "parallel-serving": ("parallel_serving", "tensor/expert-parallel serving vs one rank (docs/parallel.md)"),
    "parallel-memory": ("parallel_memory", "per-rank memory at TP/EP sizes (docs/parallel.md)"),
    "release-memory": ("release_memory", "bounded build of a release-shaped checkpoint (docs/release_memory.md)"),
    "soak": ("soak", "long mixed load with faults (docs/load.md)"),
    "faults": ("faults", "model processes killed mid-stream: time to error, not-ready, healed; sessions kept "
               "(docs/reliability.md)"),
    "quant-accuracy": ("quant_accuracy", "quantized engines: perplexity and speed vs fp32 (docs/quantization.md)"),
    "eval-harness": ("eval_harness", "lm-evaluation-harness through the OpenAI frontend (docs/openai.md)"),
    "replay-quality": ("replay_quality", "bounded replay vs full recompute (docs/replay_quality.md)"),
    "routing-ceiling": ("routing_ceiling", "what routing the encoder allows (docs/routing_ceiling.md)"),
    "compare-routers": ("compare_routers", "router recipes side by side (docs/routing_routers.md)"),
    "zero-shot-adapter": ("zero_shot_adapter", "a fifth adapter registered zero-shot (docs/routing_zero_shot.md)"),
    "answer-eval": ("answer_eval", "replies that carry the request's key fact (docs/model_card.md)"),
    "structured": ("structured_eval", "structured replies (JSON, tool calls) on held-out cases through the OpenAI "
                   "frontend (docs/model_card.md)"),
    "default-compare": ("default_compare", "the default before and after a rebuild: routing, perplexities, drafter, "
                        "replay (docs/model_card.md)"),
    "seed-sweep": ("seed_sweep", "the step-module bound of test_steps.py over hundreds of seeds (docs/testing.md)"),
    "device-check": ("device_check", "the mol2 kernels and the model loop on a GPU (docs/kernels.md)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        print(__doc__)
        for name, (_, what) in BENCHMARKS.items():
            print(f"  {name:18s} {what}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown benchmark {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    module = importlib.import_module(f"benchmarks.{BENCHMARKS[argv[0]][0]}")
    sys.argv = [f"python -m benchmarks {argv[0]}", *argv[1:]]
    return int(module.main() or 0)


if __name__ == "__main__":
    sys.exit(main())
