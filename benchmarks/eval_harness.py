"""lm-evaluation-harness against the served model, end to end: tritonserver + the OpenAI frontend on loopback, a small
local dataset written here, lm-eval's `local-completions` (loglikelihood: /v1/completions with echo + logprobs) and
`local-chat-completions` (generation: /v1/chat/completions) run from `.venv-eval` (scripts/setup_eval.sh).

    bash scripts/setup_eval.sh                       # once: lm-eval 0.4.13 in its own venv
    .venv/bin/python -m benchmarks eval-harness     # prints the results; --write-docs records them in docs/openai.md

The dataset is tiny and made up here (no download): `mol2_mc`, multiple-choice items scored by loglikelihood (lm-eval
asks for the log-probability of each choice after the question and picks the most likely), and `mol2_gen`, short
completions scored by exact match. A 10 M-parameter model trained for 30 minutes has no knowledge to speak of, so the
accuracies say little about it; what the run shows is that a standard harness drives both endpoints, and the script
checks lm-eval's loglikelihoods against the tensor API's teacher forcing for the same tokens (`forced_ids`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

EMBEDDED = ROOT / "embedded" / "mol2-small"
EVAL_PYTHON = ROOT / ".venv-eval" / "bin" / "python"
DOC = ROOT / "docs" / "openai.md"
BEGIN, END = "<!-- eval_harness:begin -->", "<!-- eval_harness:end -->"

MC_ITEMS = [
    {"question": "import os\nprint(os.", "choices": ["listdir('.'))", "the cat sat"], "gold": 0},
    {"question": "The header is sticky: position:", "choices": [" sticky;", " banana;"], "gold": 0},
    {"question": "def add(a, b):\n    return a", "choices": [" + b", " walked home"], "gold": 0},
    {"question": "git commit -m", "choices": [" \"fix\"", " purple"], "gold": 0},
    {"question": "Hi! How was your", "choices": [" day?", " int("], "gold": 0},
    {"question": "for i in range(10):\n    print(", "choices": ["i)", "margin: 0;"], "gold": 0},
    {"question": "body { margin:", "choices": [" 0; }", " import sys"], "gold": 0},
    {"question": "Thanks, that", "choices": [" helps.", " = None"], "gold": 0},
]
GEN_ITEMS = [
    {"prompt": "Say hi.", "answer": "hi"},
    {"prompt": "def mean(xs):", "answer": "return"},
    {"prompt": "Center a div in CSS.", "answer": "display: flex;"},
    {"prompt": "How do I undo the last git commit?", "answer": "git reset"},
]


def write_tasks(folder: Path, limit: int) -> None:
    """Two lm-eval task configs over local JSON lines (datasets' `json` builder: nothing is downloaded)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in MC_ITEMS[:limit]))
    (folder / "gen.jsonl").write_text("".join(json.dumps(x) + "\n" for x in GEN_ITEMS[:limit]))
    (folder / "mol2_mc.yaml").write_text(f"""task: mol2_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    (folder / "mol2_gen.yaml").write_text(f"""task: mol2_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
""")


def run_lm_eval(model: str, model_args: str, task: str, tasks: Path, out: Path,
                extra: list[str]) -> tuple[dict, float, str]:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OPENAI_API_KEY": "unused"}
    cmd = [str(EVAL_PYTHON), "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", task,
           "--include_path", str(tasks), "--output_path", str(out), "--log_samples", "--batch_size", "1", *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tasks, env=env, capture_output=True, text=True, timeout=1200)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"lm-eval {model} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    results = sorted(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)[-1]
    table = "\n".join(line for line in proc.stdout.splitlines() if line.startswith("|"))
    return json.loads(results.read_text()), took, table


def samples(out: Path, task: str) -> list[dict]:
    files = sorted(out.rglob(f"samples_{task}_*.jsonl"), key=lambda p: p.stat().st_mtime)
    return [json.loads(line) for line in files[-1].read_text().splitlines()] if files else []


def check_loglikelihoods(grpc_url: str, model_id: str, logged: list[dict],  # type: ignore[no-untyped-def]
                         tokenizer) -> tuple[int, float]:
    """Each loglikelihood lm-eval logged, recomputed through the tensor API (a raw session, the context + continuation
    tokens forced, adapter as the model id names it): (pairs checked, largest absolute difference)."""
    from tritonserver_backend.clients.client import GrpcChat, TurnRequest

    adapter = model_id.partition(":")[2] or None
    chat = GrpcChat(grpc_url)
    worst, count = 0.0, 0
    try:
        for i, sample in enumerate(logged):
            arguments = sample["arguments"]
            pairs = ([(a["arg_0"], a["arg_1"]) for a in arguments.values()] if isinstance(arguments, dict)
                     else [tuple(a) for a in arguments])
            for (context, continuation), resp in zip(pairs, sample["resps"]):
                ctx, cont = tokenizer.encode(context), tokenizer.encode(continuation)
                reply = chat.turn(TurnRequest(f"eval-check-{i}-{count}", "", new_session=True, raw=True,
                                              forced_ids=ctx + cont, max_tokens=0, adapter=adapter, logprobs=True,
                                              end_session=True))
                if reply.error:
                    raise SystemExit(f"tensor API check failed: {reply.error}")
                want = sum(reply.logprobs[len(ctx):])
                got = float(resp[0][0])
                worst, count = max(worst, abs(want - got)), count + 1
    finally:
        chat.close()
    return count, worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=8, help="items per task (at most %(default)s)")
    ap.add_argument("--model-id", default="mol2:base", help="the OpenAI model id lm-eval names (mol2 routes with MoL2)")
    ap.add_argument("--engine-backend", default="torch",
                    help="the server's engine backend (torch needs no engine build)")
    ap.add_argument("--write-docs", action="store_true", help="record the output in docs/openai.md")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (server logs, lm-eval outputs)")
    args = ap.parse_args(argv)
    if not EVAL_PYTHON.exists():
        raise SystemExit(f"{EVAL_PYTHON} is missing: run bash scripts/setup_eval.sh first")

    from ced.text.tokenizer import ChatTokenizer
    from openai_frontend.process import FrontendProcess
    from tritonserver_backend.launcher import TritonServer
    from tritonserver_backend.repository import build_repository

    work = Path(tempfile.mkdtemp(prefix="mol2-eval-"))
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    params = {"model_dir": str(EMBEDDED), "registry_root": str(work / "registry"), "max_context": "2048",
              "engine_backend": args.engine_backend, "max_active_turns": "4", "max_queued_turns": "8"}
    server = TritonServer(work_dir=work / "server")
    server.registry_root = work / "registry"
    frontend = None
    started = time.perf_counter()
    try:
        server.start(build_repository(work / "repo", params))
        server.wait_ready(300)
        frontend = FrontendProcess(server.grpc_url, EMBEDDED, log_file=work / "frontend.log").start()
        frontend.wait_ready(60)
        ready = time.perf_counter() - started
        tasks = work / "tasks"
        write_tasks(tasks, args.limit)
        base = frontend.base_url
        version = subprocess.run([str(EVAL_PYTHON), "-c",
                                  "import importlib.metadata as m; print(m.version('lm-eval'))"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        say(f"lm-eval {version} (.venv-eval) against tritonserver ({args.engine_backend} engine, embedded/mol2-small) "
            f"+ the OpenAI frontend, model id {args.model_id!r}; server and frontend ready in {ready:.0f} s "
            f"({time.strftime('%b %d %Y %H:%M UTC', time.gmtime())})")
        mc_args = (f"model={args.model_id},base_url={base}/completions,tokenizer_backend=huggingface,tokenizer="
                   f"{EMBEDDED},tokenized_requests=True,num_concurrent=1,max_retries=1,timeout=300")
        mc, mc_s, mc_table = run_lm_eval("local-completions", mc_args, "mol2_mc", tasks, work / "out-mc", [])
        gen_args = f"model={args.model_id},base_url={base}/chat/completions,num_concurrent=1,max_retries=1,timeout=300"
        gen, gen_s, gen_table = run_lm_eval("local-chat-completions", gen_args, "mol2_gen", tasks, work / "out-gen",
                                            ["--apply_chat_template"])
        r_mc, r_gen = mc["results"]["mol2_mc"], gen["results"]["mol2_gen"]
        n_mc, n_gen = mc["n-samples"]["mol2_mc"]["effective"], gen["n-samples"]["mol2_gen"]["effective"]
        say()
        say(f"local-completions (loglikelihood, /v1/completions echo + logprobs), mol2_mc, {n_mc} items x 2 choices, "
            f"{mc_s:.0f} s:")
        say(mc_table)
        say()
        say(f"local-chat-completions (generate_until, /v1/chat/completions), mol2_gen, {n_gen} items, {gen_s:.0f} s:")
        say(gen_table)
        logged = samples(work / "out-mc", "mol2_mc")
        count, worst = check_loglikelihoods(server.grpc_url, args.model_id, logged, ChatTokenizer.load(EMBEDDED))
        say()
        say(f"check: {count} loglikelihoods lm-eval computed = the tensor API's teacher forcing of the same tokens "
            f"(largest difference {worst:.2e})")
        for s in samples(work / "out-gen", "mol2_gen")[:args.limit]:
            say(f"  generated for {s['doc']['prompt']!r}: {s['filtered_resps'][0]!r}")
        summary = {"mol2_mc": {k: v for k, v in r_mc.items() if re.match(r"acc", k)},
                   "mol2_gen": {k: v for k, v in r_gen.items() if k.startswith("exact_match")}}
        say()
        say("results: " + json.dumps(summary, sort_keys=True))
        if worst > 1e-4:
            raise SystemExit(f"lm-eval's loglikelihoods differ from the tensor API's by {worst}")
    finally:
        if frontend is not None:
            frontend.stop()
        server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work folder kept: {work}")
    if args.write_docs:
        record(lines)
    return 0


def record(lines: list[str]) -> None:
    text = DOC.read_text()
    block = f"{BEGIN}\n```text\n$ .venv/bin/python -m benchmarks eval-harness\n" + "\n".join(lines) + f"\n```\n{END}"
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    DOC.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
