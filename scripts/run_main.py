"""The main job: serve the embedded default with a real tritonserver and hold a scripted multi-turn conversation.

Steps: build a model repository for the embedded default (configs from the tensor contract, a fresh adapter
registry), start tritonserver on free loopback ports, wait until ready, run a conversation that visits several
domains (routed turns and one explicit override) over gRPC streaming, print every streamed reply with the adapter
chosen, show the routing counters from the metrics port, and stop the server. With --openai the OpenAI-compatible
frontend (docs/openai.md) starts beside the server and a short conversation goes through it with the `openai` client.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
import urllib.request
from pathlib import Path

from build_engines.build.cli import main as build_engines_main
from tritonserver_backend.clients.client import GrpcChat, TurnRequest
from tritonserver_backend.clients.scripted import CONVERSATION
from tritonserver_backend.launcher import TritonServer
from tritonserver_backend.repository import build_repository

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "embedded" / "mol2-small"
DEFAULT_BANNER = """\
What this serves: the embedded default, embedded/mol2-small. It is a 10 M-parameter model with every layer role of
DeepSeek-V4.1-Flash, trained for about 80 minutes on 2 CPU cores, with four LoRA adapters and a MoL2 router. Its
free-text replies look like noise (JSON fragments, "; } } }"): they show routing, bounded replay and streaming, not
language ability; JSON-schema replies and forced tool calls do finish (docs/model_card.md). To serve another
checkpoint: bash scripts/main.sh --model DIR (our format or a release directory with its config.json and
model.safetensors.index.json; docs/release.md).
"""


def checkpoint_problem(model: Path) -> str | None:
    """Why `model` cannot be served by this job (None when it can): its config, its weights, its router and adapters."""
    from ced.formats.config_file import CheckpointError, load_config

    if model.resolve() == DEFAULT_MODEL.resolve() and not (model / "model.safetensors").exists():
        return f"{model} has no model: build it with `python -m build_engines default`"
    try:
        load_config(model)
    except CheckpointError as exc:
        return f"{model} is not a checkpoint this system can load: {exc}"
    if not list(model.glob("*.safetensors")):
        return f"{model} holds no *.safetensors weights"
    if not (model / "adapters").is_dir():
        return (f"{model} has no adapters/: the served conversation routes between LoRA adapters (docs/pipeline.md "
                "says how the default's were trained; `python -m build_engines release-shaped --adapters` writes "
                "random ones for a release-shaped checkpoint)")
    return None


def router_note(model: Path) -> str | None:
    """What to say when `model` has no trained router head: serving then routes with a seeded random head."""
    if (model / "router").is_dir():
        return None
    return (f"note: {model} has no router/ (a trained MoL2 head): turns are routed by a seeded random head, arbitrary "
            f"but the same in every process; an explicit adapter still wins")


def choose_engine(asked: str, model: Path, engines: Path) -> str:
    """The engine backend to serve: what was asked, or for `auto` the ONNX engines when current ones are built and
    else the torch engine (the same step modules in PyTorch), saying why and how to build the ONNX ones. Why: the
    ONNX export takes minutes on two cores, and a first run should show a served conversation before that."""
    if asked != "auto":
        return asked
    from ced.engine_dir.manifest import BuildSettings, stale_reason
    from ced.steps.opset import OPSET

    reason = stale_reason(engines, model, BuildSettings("onnx", "none", OPSET, "none"))
    if reason is None:
        return "onnx"
    print(f"engines: serving with the torch engine: the ONNX engines in {engines} are not current ({reason}); "
          "`bash scripts/main.sh --engine onnx` builds them (minutes on 2 cores) and serves them\n")
    return "torch"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                   help="checkpoint directory: ours or a release directory (config.json + shards), with adapters/ (and "
                   "router/)")
    p.add_argument("--work", type=Path, default=ROOT / "artifacts" / "main")
    p.add_argument("--engines", type=Path, default=None,
                   help="ONNX engine directory, built or reused (default: artifacts/engines/<model directory name>)")
    p.add_argument("--engine", choices=["auto", "onnx", "torch"], default="auto",
                   help="onnx: build the ONNX engines (minutes on 2 cores the first time; reused once built) and "
                   "serve them; torch: serve the checkpoint's step modules in PyTorch, no build; auto (default): onnx "
                   "when current engines are there, else torch, so that the first reply never waits for a build")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--openai", action="store_true",
                   help="also start the OpenAI-compatible frontend and talk to it with the openai client")
    p.add_argument("--openai-port", type=int, default=0, help="the frontend's port (0: a free one)")
    args = p.parse_args()
    if args.model.resolve() == DEFAULT_MODEL.resolve():
        print(DEFAULT_BANNER)
    else:
        print(f"What this serves: the checkpoint in {args.model} (not the embedded default).\n")
    problem = checkpoint_problem(args.model)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    note = router_note(args.model)
    if note:
        print(note)
    if args.engines is None:
        args.engines = ROOT / "artifacts" / "engines" / args.model.resolve().name
    if args.work.exists():
        shutil.rmtree(args.work)
    engines = args.engines.resolve()
    backend = choose_engine(args.engine, args.model.resolve(), engines)
    if backend == "onnx":
        print(f"engines: python -m build_engines build --model {args.model} --out {args.engines}")
        if build_engines_main(["--model", str(args.model), "--out", str(engines)]) != 0:
            return 1
    params = {"model_dir": str(args.model.resolve()), "registry_root": str((args.work / "registry").resolve()),
              "engine_dir": str(engines), "engine_backend": backend}
    repo = build_repository(args.work / "model_repository", params)
    print(f"model repository: {repo} (models: preprocess, encoder, router, decoder, adapter_admin, session_control; "
          f"ensemble mol2; {backend} engines)")
    server = TritonServer(work_dir=args.work / "server")
    server.start(repo)
    try:
        print(f"tritonserver {server.install.binary} starting (PID {server.pid}, gRPC {server.grpc_url}, HTTP "
              f"{server.http_url}) ...")
        print(f"ready after {server.wait_ready(300):.1f} s")
        chat = GrpcChat(server.grpc_url)
        for i, (adapter, text) in enumerate(CONVERSATION):
            print(f"\n[turn {i + 1}] user{' (explicit adapter ' + adapter + ')' if adapter else ''}: {text}")
            print("assistant: ", end="", flush=True)
            t0 = time.perf_counter()
            reply = chat.turn(TurnRequest("main-demo", text, new_session=i == 0, adapter=adapter,
                                          max_tokens=args.max_tokens), on_piece=lambda s: print(s, end="", flush=True))
            if reply.error:
                print(f"\n  [error] {reply.error}")
                return 1
            how = "explicit override" if adapter else "routed by MoL2"
            print(f"\n  -> adapter {reply.adapter} ({how}); {len(reply.token_ids)} tokens in "
                  f"{time.perf_counter() - t0:.2f} s; finish: {reply.finish_reason}")
        chat.close()
        if args.openai and openai_conversation(server, args) != 0:
            return 1
        metrics = urllib.request.urlopen(server.metrics_url).read().decode()
        print("\nrouting counters (Triton custom metrics):")
        for line in metrics.splitlines():  # histogram buckets left out: their _count and _sum say it
            if line.startswith("mol2_") and "_bucket{" not in line:
                print(f"  {line}")
    finally:
        server.stop()
        print("server stopped")
    return 0


def openai_conversation(server: TritonServer, args: argparse.Namespace) -> int:
    """The frontend beside the server, two turns with the real `openai` client (the second resends the first)."""
    import openai

    from openai_frontend.process import FrontendProcess

    frontend = FrontendProcess(server.grpc_url, args.model.resolve(), port=args.openai_port or None,
                               log_file=args.work / "openai_frontend.log")
    with frontend:
        print(f"\nOpenAI frontend: {frontend.base_url} (ready after {frontend.wait_ready(60):.1f} s)")
        client = openai.OpenAI(base_url=frontend.base_url, api_key="unused")
        messages: list[dict] = []
        for text in ("Hi! Can you help me with some CSS?", ".card { display: flex; justify-content: space-between; }"):
            messages.append({"role": "user", "content": text})
            raw = client.chat.completions.with_raw_response.create(model="mol2", messages=messages,
                                                                   max_tokens=args.max_tokens)
            done = raw.parse()
            reply = done.choices[0].message.content
            print(f"[openai] user: {text}\n[openai] assistant: {reply}")
            print(f"  -> adapter {done.adapter} (x-mol2-adapter: {raw.headers['x-mol2-adapter']}); session reused: "
                  f"{raw.headers['x-mol2-session-reused']}; usage {done.usage.prompt_tokens} prompt "
                  f"({done.usage.prompt_tokens_details.cached_tokens} cached) + {done.usage.completion_tokens} "
                  "completion tokens")
            messages.append({"role": "assistant", "content": reply})
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
