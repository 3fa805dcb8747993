"""The OpenAI frontend under a chat workload: NVIDIA AIPerf against it, and its overhead against the direct gRPC path.

    .venv/bin/python -m benchmarks openai [--engine-backend onnx|torch] [--concurrency 4] [--requests 32]
        [--tokens 32]

Starts tritonserver (embedded default) and the frontend on loopback ports, then, in one run:
1. the same prompts through the tensor API (GrpcChat, gRPC streaming) and through the frontend (the `openai` client,
   streaming), at the same concurrency, greedy, so both paths generate the same tokens: TTFT, inter-token latency,
   tokens/s, and the frontend's overhead per token;
2. AIPerf (`aiperf profile`, synthetic chat prompts) against the frontend. AIPerf pulls numpy 2, which the main venv
   must not have (Triton's Python-backend stub), so it lives in `.venv-aiperf` (created here when missing) and counts
   tokens with a local tokenizer folder made from the model's tokenizer.json (no hub access).
Writes its section of docs/openai.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from benchmarks.harness import (
    EMBEDDED,
    ROOT,
    default_params,
    ensure_engines,
    refuse_to_overwrite,
    served,
    write_section,
)
from openai_frontend.process import FrontendProcess
from tritonserver_backend.clients.client import GrpcChat, TurnRequest

AIPERF_VENV = ROOT / ".venv-aiperf"
PROMPTS = ["Hi! How was your day?", "def mean(xs):\n    return sum(xs) / len(xs)",
           "Make the header sticky with a shadow.", "git log --oneline shows nothing, why?", "Tell me about ships.",
           ".card { display: flex; padding: 1rem; }", "tar -czvf backup.tar.gz /home/user/docs",
           "What should I cook tonight?"]


def timed(path: str, fn, prompts: list[str], concurrency: int) -> dict:  # type: ignore[no-untyped-def]
    """Run `fn(i, prompt) -> list of piece arrival times (s, from the request's start)` over the prompts."""
    records: list[list[float]] = []
    lock = threading.Lock()
    bar = tqdm(total=len(prompts), desc=path, leave=False)

    def one(item: tuple[int, str]) -> None:
        times = fn(*item)
        with lock:
            records.append(times)
            bar.update()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, enumerate(prompts)))
    wall = time.perf_counter() - t0
    bar.close()
    tokens = sum(len(r) for r in records)
    itl = [(r[-1] - r[0]) / (len(r) - 1) for r in records if len(r) > 1]
    return {"ttft_ms": 1000 * statistics.mean(r[0] for r in records), "itl_ms": 1000 * statistics.mean(itl),
            "tokens": tokens, "tokens_per_s": tokens / wall, "wall_s": wall}


def grpc_path(url: str, tokens: int):  # type: ignore[no-untyped-def]
    def run(i: int, prompt: str) -> list[float]:
        chat, times = GrpcChat(url), []
        t0 = time.perf_counter()
        reply = chat.turn(TurnRequest(f"bench-grpc-{i}-{time.time_ns()}", prompt, new_session=True, max_tokens=tokens),
                          on_piece=lambda _: times.append(time.perf_counter() - t0))
        chat.close()
        assert reply.error is None, reply.error
        return times
    return run


def openai_path(base_url: str, tokens: int):  # type: ignore[no-untyped-def]
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)

    def run(i: int, prompt: str) -> list[float]:
        times: list[float] = []
        t0 = time.perf_counter()
        for chunk in client.chat.completions.create(model="mol2", messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=tokens, stream=True):
            if chunk.choices and chunk.choices[0].delta.content is not None and chunk.choices[0].delta.role is None:
                times.append(time.perf_counter() - t0)
        return times
    return run


def tokenizer_folder(out: Path) -> Path:
    """An HF tokenizer folder (tokenizer.json + config) from the model's own tokenizer, for AIPerf's token counts."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(EMBEDDED / "tokenizer.json", out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "model_max_length": 2048}))
    return out


def ensure_aiperf() -> Path:
    exe = AIPERF_VENV / "bin" / "aiperf"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(AIPERF_VENV)], check=True)
        subprocess.run([str(AIPERF_VENV / "bin" / "pip"), "install", "--quiet", "aiperf"], check=True)
    return exe


def run_aiperf(base_url: str, args: argparse.Namespace, work: Path) -> dict:
    out = work / "aiperf"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [str(ensure_aiperf()), "profile", "--model", "mol2", "--url", base_url.removesuffix("/v1"), "--endpoint-type",
           "chat", "--streaming", "--tokenizer", str(tokenizer_folder(work / "tokenizer")), "--concurrency",
           str(args.concurrency), "--request-count", str(args.requests), "--synthetic-input-tokens-mean", "32",
           "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(args.tokens), "--output-tokens-stddev",
           "0", "--use-server-token-count", "--random-seed", "0", "--artifact-dir", str(out), "--ui-type", "none"]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=work, stdout=subprocess.DEVNULL)
    data = json.loads((out / "profile_export_aiperf.json").read_text())
    data["command"] = " ".join(["aiperf", *cmd[1:]]).replace(str(work), "<work>")
    return data


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine-backend", default="onnx", choices=["torch", "onnx"],
                   help="onnx: the served default (built or reused)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--work", type=Path, default=ROOT / "artifacts" / "bench_openai")
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "openai.md")
    p.add_argument("--force", action="store_true", help="overwrite the committed --doc file (docs/openai.md)")
    args = p.parse_args()
    refuse_to_overwrite([args.doc], args.force, "--doc FILE")
    shutil.rmtree(args.work, ignore_errors=True)
    params = default_params(registry_root=str(args.work / "registry"), engine_backend=args.engine_backend)
    if args.engine_backend == "onnx":
        ensure_engines()
    else:
        del params["engine_dir"]
    with served(args.work, params) as server:
        with FrontendProcess(server.grpc_url, EMBEDDED, log_file=args.work / "frontend.log") as frontend:
            frontend.wait_ready(60)
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
            timed("warm-up", grpc_path(server.grpc_url, 4), PROMPTS[:2], 1)
            timed("warm-up", openai_path(frontend.base_url, 4), PROMPTS[:2], 1)
            direct = timed("grpc", grpc_path(server.grpc_url, args.tokens), prompts, args.concurrency)
            front = timed("openai", openai_path(frontend.base_url, args.tokens), prompts, args.concurrency)
            aiperf = run_aiperf(frontend.base_url, args, args.work)
    write_section(args.doc, section(args, direct, front, aiperf), "## Measured: AIPerf and the frontend's overhead",
                  "# OpenAI-compatible frontend")
    print(section(args, direct, front, aiperf))
    return 0


def section(args: argparse.Namespace, direct: dict, front: dict, aiperf: dict) -> str:
    def m(key: str, stat: str = "avg") -> str:
        return f"{aiperf[key][stat]:.1f}"
    over_itl = front["itl_ms"] - direct["itl_ms"]
    over_ttft = front["ttft_ms"] - direct["ttft_ms"]
    return f"""## Measured: AIPerf and the frontend's overhead
`.venv/bin/python -m benchmarks openai --engine-backend {args.engine_backend} --concurrency {args.concurrency} \
--requests {args.requests} --tokens {args.tokens}`
on the 2-core CPU machine ({args.engine_backend} engine; another job shared the machine during the run, so absolute \
figures are
pessimistic; the two paths of the comparison ran back to back in the same run).

Same {args.requests} prompts, {args.concurrency} concurrent streams, greedy, up to {args.tokens} tokens, one new \
conversation per request:

| path | mean TTFT (ms) | mean inter-token latency (ms) | tokens | tokens/s |
|---|---|---|---|---|
| tensor API, gRPC streaming (`GrpcChat`) | {direct['ttft_ms']:.1f} | {direct['itl_ms']:.2f} | {direct['tokens']} | \
{direct['tokens_per_s']:.1f} |
| OpenAI frontend, `openai` client, SSE | {front['ttft_ms']:.1f} | {front['itl_ms']:.2f} | {front['tokens']} | \
{front['tokens_per_s']:.1f} |

Frontend overhead: {over_itl:+.2f} ms per token (inter-token latency), {over_ttft:+.1f} ms on the first token,
{100 * (front['tokens_per_s'] / direct['tokens_per_s'] - 1):+.1f}% throughput.

AIPerf {aiperf.get('aiperf_version', '')} against the frontend (synthetic chat prompts of 32 tokens, {args.tokens} \
output tokens
requested, server-reported token counts):

| metric | avg | p50 | p99 |
|---|---|---|---|
| time to first token (ms) | {m('time_to_first_token')} | {m('time_to_first_token', 'p50')} | \
{m('time_to_first_token', 'p99')} |
| inter-token latency (ms) | {m('inter_token_latency')} | {m('inter_token_latency', 'p50')} | \
{m('inter_token_latency', 'p99')} |
| request latency (ms) | {m('request_latency')} | {m('request_latency', 'p50')} | {m('request_latency', 'p99')} |
| output tokens per request | {m('output_sequence_length')} | {m('output_sequence_length', 'p50')} | \
{m('output_sequence_length', 'p99')} |

Throughput: {aiperf['output_token_throughput']['avg']:.1f} output tokens/s, {aiperf['request_throughput']['avg']:.2f} \
requests/s over
{aiperf['request_count']['avg']:.0f} requests.

```
{aiperf['command']}
```
"""


if __name__ == "__main__":
    sys.exit(main())
