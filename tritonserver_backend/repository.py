"""Render the model repository's config.pbtxt files from the tensor contract.

`python -m tritonserver_backend.repository --out DIR` writes a deployable repository (configs, model.py files, absolute
paths); `--out model_repository --force` rewrites the committed configs (a test checks they match the contract). Paths
in the parameters are relative to the project root (the model repository's parent), so
`tritonserver --model-repository model_repository` serves the embedded default as it is.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tritonserver_backend import contract as c
from tritonserver_backend.core.drafting import DRAFT_BATCH, check_speculative
from tritonserver_backend.core.encoder_service import DEFAULT_PREFILL_STEP
from tritonserver_backend.core.prefix_cache import DEFAULT_BUDGET_BYTES
from tritonserver_backend.core.scheduler import DEFAULT_REPLAY_BUDGET
from tritonserver_backend.core.turn_lease import DEFAULT_LEASE_S

DEFAULT_PARAMETERS = {
    "model_dir": "embedded/mol2-small",
    "registry_root": "artifacts/registry",
    "engine_backend": "onnx",  # torch | onnx | trt
    "engine_dir": "artifacts/engines/mol2-small",  # built by `python -m build_engines build` (scripts/main.sh does it)
    "max_context": "8192",
    "session_budget_bytes": str(2 << 30),
    "max_active_turns": "32",  # rows of one batched decode step
    "max_queued_turns": "64",  # turns waiting for a row; beyond active + queued a new turn gets "server busy" at once
    # seconds a turn the encoder handed over waits for the decoder to take it before it is rolled back and its slot
    # freed (turn_lease.py): only a client that calls the encoder model alone leaves one waiting; 0: never
    "turn_lease_s": str(int(DEFAULT_LEASE_S)),
    "stream_interval": "1",  # tokens per streamed response (the last one of a turn flushes the rest); docs/load.md
    "decode_lanes": "1",  # 2: one lane's encoder step overlaps the other's decoder step (docs/load.md); 1: one batch
    # positions of bounded replay that starting turns may run in one iteration while others decode (0: no bound)
    "replay_tokens_per_step": str(DEFAULT_REPLAY_BUDGET),
    "prefill_chunk": "256",  # the most tokens of one prefill engine call; the prefix cache's block
    # a long prompt's prefill advances this many tokens between two decoder steps (docs/load.md, "Chunked prefill");
    # prefill_between_steps false: a turn's prefill runs whole on arrival, every stream waiting (as before issue 49)
    "prefill_tokens_per_step": str(DEFAULT_PREFILL_STEP),
    "prefill_between_steps": "true",
    # the encoder's prefix cache (docs/prefix_cache.md): bytes of cached prompt prefixes, beside session_budget_bytes
    # (0: off); its block is prefill_chunk
    "prefix_cache_bytes": str(DEFAULT_BUDGET_BYTES),
    # speculative decoding (docs/speculative.md): the drafter (auto: the model's DSpark drafter where its engines
    # hold one, else off; dspark; ngram: prompt lookup over the reply; off), drafts per step, the confidence below
    # which a DSpark block is cut (0: never), and the most turns a lane may have going for its steps to draft (a
    # loaded batch decodes plainly)
    "speculative": "auto",
    "speculative_block": "5",  # DSpark's block (the release's dspark_block_size)
    "speculative_confidence": "0",
    "speculative_batch": str(DRAFT_BATCH),
    "torch_threads": "1",
    # tensor / expert parallelism (docs/parallel.md): the encoder and the decoder each run on this many ranks, which
    # their Triton model instance starts and leads; expert parallel places routed experts whole. Torch engine only.
    "tensor_parallel_size": "1",
    "enable_expert_parallel": "false",
    # sessions (docs/serving.md, "Session tokens")
    "session_auth": "true",  # false: no session tokens (a trusted single-tenant deployment only; the log says so)
    # empty: <registry_root>/internal.key (0600, created at the first start): signs calls between the models
    "internal_key_file": "",
    # the session journal (docs/reliability.md): completed turns on disk, so a dead model process or a server restart
    # loses no session. Empty: $MOL2_SESSION_DIR, else sessions/ under the server's working directory (the launcher's
    # work dir); "off": sessions live in memory only. Sessions not written for ttl are dropped at start, and past the
    # byte budget the least recently written ones lose their journal (whole, each logged by name)
    "session_dir": "",
    "session_journal_ttl_s": str(7 * 24 * 3600),
    "session_journal_bytes": str(1 << 30),
    # adapter_admin (docs/admin.md)
    "admin_enabled": "true",  # false: every action except list is refused
    "admin_key_file": "",  # empty: <registry_root>/admin.key, created 0600 at the first start
    "adapter_roots": "",  # colon-separated folders adapters may be loaded from besides the registry root
    "max_adapters": "32",
    "max_adapter_rank": "64",
    "max_adapter_bytes": str(1 << 30),  # size of adapter_model.safetensors, checked before it is read
}
ENGINE = ("engine_backend", "engine_dir", "torch_threads")
# the encoder and the decoder; the router's pointer head stays one process
PARALLEL = ("tensor_parallel_size", "enable_expert_parallel")
PYTHON_MODELS_USING = {
    "preprocess": ("model_dir", "registry_root"),
    "encoder": ("model_dir", "registry_root", *ENGINE, *PARALLEL, "max_context", "session_budget_bytes",
                "max_active_turns", "max_queued_turns", "turn_lease_s", "prefill_chunk", "prefill_tokens_per_step",
                "prefill_between_steps", "prefix_cache_bytes", "session_auth", "internal_key_file", "session_dir",
                "session_journal_ttl_s", "session_journal_bytes"),
    "router": ("model_dir", "registry_root", *ENGINE),
    "decoder": ("model_dir", "registry_root", *ENGINE, *PARALLEL, "max_context", "session_budget_bytes",
                "max_active_turns", "decode_lanes", "replay_tokens_per_step", "stream_interval",
                "internal_key_file", "speculative", "speculative_block", "speculative_confidence", "speculative_batch"),
    "adapter_admin": ("model_dir", "registry_root", "admin_enabled", "admin_key_file", "adapter_roots", "max_adapters",
                      "max_adapter_rank", "max_adapter_bytes"),
    "session_control": ("registry_root", "internal_key_file"),
}


def parallel_backend(backend: str | None, tensor_parallel_size: int, expert_parallel: bool) -> str:
    """The engine backend a rendering gets: the one asked for, else the default, else torch when the roles run on
    several ranks (the only engine that serves them; docs/parallel.md). A contradiction is a ValueError."""
    if tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {tensor_parallel_size}")
    if expert_parallel and tensor_parallel_size < 2:
        raise ValueError("--enable-expert-parallel places experts over the tensor-parallel ranks: it needs "
                         "--tensor-parallel-size 2 or more")
    if tensor_parallel_size == 1:
        return backend or DEFAULT_PARAMETERS["engine_backend"]
    if backend not in (None, "torch"):
        raise ValueError(f"--tensor-parallel-size {tensor_parallel_size} runs on the torch engine, not {backend}: "
                         "onnxruntime has no collective op (docs/parallel.md)")
    return "torch"


def _io(kind: str, specs: tuple[c.TensorSpec, ...]) -> str:
    return f"{kind} [\n" + ",\n".join(s.pbtxt() for s in specs) + "\n]"


def python_model_config(model: c.ModelSpec, params: dict[str, str]) -> str:
    lines = [f'name: "{model.name}"', 'backend: "python"', f"max_batch_size: {model.max_batch_size}"]
    if model.decoupled:
        lines.append("model_transaction_policy {\n  decoupled: true\n}")
    lines += [_io("input", model.inputs), _io("output", model.outputs)]
    lines.append("instance_group [\n  {\n    count: 1\n    kind: KIND_CPU\n  }\n]")
    for key in PYTHON_MODELS_USING[model.name]:
        lines.append(f'parameters {{\n  key: "{key}"\n  value: {{ string_value: "{params[key]}" }}\n}}')
    return "\n".join(lines) + "\n"


def ensemble_config() -> str:
    lines = [f'name: "{c.ENSEMBLE_NAME}"', 'platform: "ensemble"', "max_batch_size: 0", _io("input", c.ENSEMBLE_INPUTS),
             _io("output", c.ENSEMBLE_OUTPUTS), "ensemble_scheduling {\n  step ["]
    steps = []
    for model, inputs, outputs in c.ensemble_steps():
        body = [f'      model_name: "{model.name}"', "      model_version: -1"]
        body += [f'      input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
        body += [f'      output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
        steps.append("    {\n" + "\n".join(body) + "\n    }")
    lines.append(",\n".join(steps))
    lines.append("  ]\n}")
    return "\n".join(lines) + "\n"


def render(out: Path, params: dict[str, str] | None = None) -> dict[Path, str]:
    params = {**DEFAULT_PARAMETERS, **(params or {})}
    files = {out / m.name / "config.pbtxt": python_model_config(m, params) for m in c.MODELS}
    files[out / c.ENSEMBLE_NAME / "config.pbtxt"] = ensemble_config()
    return files


SOURCE_REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"


def build_repository(out: Path, params: dict[str, str]) -> Path:
    """A deployable copy: rendered configs plus each model's model.py (e.g. with absolute paths, for tests)."""
    for path, text in render(out, params).items():
        (path.parent / "1").mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        source = SOURCE_REPOSITORY / path.parent.name / "1" / "model.py"
        if source.exists():
            (path.parent / "1" / "model.py").write_text(source.read_text())
    return out


def contract_markdown() -> str:
    """The tensor contract as markdown tables (pasted into docs/serving.md; a test keeps them in sync)."""
    out = []
    for title, inputs, outputs in [(f"ensemble `{c.ENSEMBLE_NAME}` (what clients call)", c.ENSEMBLE_INPUTS,
                                    c.ENSEMBLE_OUTPUTS)] + [
            (f"model `{m.name}`" + (" (decoupled)" if m.decoupled else ""), m.inputs, m.outputs) for m in c.MODELS]:
        out += [f"### {title}", "", "| direction | name | type | shape | optional | meaning |",
                "|---|---|---|---|---|---|"]
        for direction, specs in (("in", inputs), ("out", outputs)):
            for s in specs:
                doc = s.doc.replace("|", "\\|")
                out.append(f"| {direction} | `{s.name}` | {s.dtype} | {list(s.dims)} | {'yes' if s.optional else ''} | "
                           f"{doc} |")
        out.append("")
    return "\n".join(out)


# resolved against the project root
PATH_PARAMETERS = ("model_dir", "registry_root", "engine_dir", "admin_key_file", "internal_key_file")
PROJECT_ROOT = SOURCE_REPOSITORY.parent


def absolute_paths(params: dict[str, str]) -> dict[str, str]:
    """Relative path parameters made absolute against the project root: the models resolve relative ones against
    their repository's parent, which is the project root only for the committed `model_repository`."""
    out = dict(params)
    for key in PATH_PARAMETERS:
        if out.get(key) and not Path(out[key]).is_absolute():
            out[key] = str(PROJECT_ROOT / out[key])
    if out.get("adapter_roots"):
        out["adapter_roots"] = ":".join(p if Path(p).is_absolute() else str(PROJECT_ROOT / p)
                                        for p in out["adapter_roots"].split(":"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="--out DIR writes a deployable repository (configs and model.py files, paths made absolute); "
               "rewriting the committed model_repository/ needs --out model_repository --force.")
    parser.add_argument("--out", type=Path, required=True, help="folder of the repository to write")
    parser.add_argument("--force", action="store_true", help="allowed to rewrite the committed model_repository/")
    for key, value in DEFAULT_PARAMETERS.items():
        if key == "enable_expert_parallel":  # a flag, as vLLM's
            parser.add_argument("--enable-expert-parallel", action="store_const", const="true", default=value,
                                help="place routed experts whole over the tensor-parallel ranks")
        elif key == "engine_backend":
            parser.add_argument("--engine-backend", default=None, help=f"torch | onnx | trt (default {value}; torch "
                                "with --tensor-parallel-size above 1)")
        else:
            parser.add_argument(f"--{key.replace('_', '-')}", default=value)
    args = parser.parse_args(argv)
    params = {k: getattr(args, k) for k in DEFAULT_PARAMETERS}
    try:
        check_speculative(params["speculative"], int(params["speculative_block"]),
                          float(params["speculative_confidence"]))
        params["engine_backend"] = parallel_backend(args.engine_backend, int(params["tensor_parallel_size"]),
                                                    params["enable_expert_parallel"] == "true")
    except ValueError as exc:
        parser.error(str(exc))
    if args.out.resolve() == SOURCE_REPOSITORY.resolve():
        if not args.force:
            parser.error(f"{args.out} is the committed repository (its configs are checked against the contract); "
                         "render elsewhere with --out DIR, or pass --force to rewrite it")
        written = render(args.out, params)
        for path, text in written.items():
            path.write_text(text)
    else:
        build_repository(args.out, absolute_paths(params))
        written = render(args.out, params)
    for path in written:
        print(f"wrote {path}")
    if args.out.resolve() != SOURCE_REPOSITORY.resolve():
        print(f"serve it: tritonserver --model-repository {args.out}   (or scripts/tritonserver.py start "
              f"--model-repository {args.out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
