"""Encoder state bytes of sessions that open with one system prompt, with the prefix cache and without, and what one
cached token costs at the default's and at DeepSeek-V4.1-Flash's size.

    .venv/bin/python -m benchmarks prefix-state-bytes [--prompt-tokens 4096] [--sessions 8] [--out docs/prefix_cache.md]

In process, on the onnx engines of the embedded default (bytes do not depend on timing): two pipelines, one with the
cache (256 MiB) and one without; each opens `--sessions` sessions with the same system prompt of about
`--prompt-tokens` tokens and a question of its own (one turn of 8 greedy tokens), then the sessions' encoder state
bytes and the cache's are read. With the cache, an idle session rests on the cached prefix (resting_rows.py) and
holds only what is its own. A second turn of each session must give the tokens the cache-free pipeline gives, or the
run fails.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchmarks.harness import (
    DEFAULT_ENGINES,
    EMBEDDED,
    ROOT,
    ensure_engines,
    figure_link,
    refuse_to_overwrite,
    save_figure,
    write_section,
)
from benchmarks.prefix_cache import document
from ced.model.config import PRESETS, CEDConfig
from ced.text.tokenizer import ChatTokenizer
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.core.pipeline import InProcessPipeline
from tritonserver_backend.sampling.sampler import SamplingParams

SECTION = "## Measured: encoder state bytes of sessions on one system prompt (benchmarks/prefix_state_bytes.py)"
MiB = 1 << 20


def per_token_bytes(cfg: CEDConfig) -> dict[str, float]:
    """Bytes one cached position adds to an entry (fp32 state): the encoder's global-KV and index-key stores (a ratio-2
    source keeps one entry per two positions) and the hand-over rows kept for every position (the layer-E global-KV
    and index-key entries, H19); and what an entry holds once, whatever its length: the replay window's rows."""
    f32, i64 = 4, 8
    stores = sum((cfg.head_dim + cfg.index_head_dim) * f32 / cfg.compress_ratios[s] for s in cfg.kv_source_layers)
    rows = (cfg.head_dim + cfg.index_head_dim + cfg.dim) * f32
    window = cfg.window_size * ((cfg.hc_mult * cfg.dim + cfg.hc_mult) * f32
                                + (cfg.index_topk + cfg.candidate_topk_blocks) * i64)
    return {"stores": stores, "rows": rows, "window": window}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "prefix_cache.md")
    p.add_argument("--figure", type=Path, default=ROOT / "docs" / "figures" / "prefix_state_bytes.png")
    p.add_argument("--force", action="store_true", help="overwrite the committed --out file and figure")
    args = p.parse_args()
    refuse_to_overwrite([args.out, args.figure], args.force, "--out FILE / --figure FILE")
    ensure_engines()
    tokenizer = ChatTokenizer.load(EMBEDDED)
    system = document(tokenizer, args.prompt_tokens, seed=4242)
    params = SamplingParams(max_tokens=8)
    held: dict[str, tuple[int, int]] = {}
    replies: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, budget in (("without the cache", 0), ("with the cache", 256 * MiB)):
            root = Path(tmp) / name.replace(" ", "-")
            ensure_registry(root, EMBEDDED)
            pipe = InProcessPipeline(EMBEDDED, root, backend="onnx", engine_dir=DEFAULT_ENGINES,
                                     max_context=args.prompt_tokens + 1024, prefix_cache_bytes=budget)
            got = [pipe.chat(f"s{i}", f"{system}\nQuestion {i}: which card is widest?", new_session=True,
                             params=params).token_ids for i in range(args.sessions)]
            held[name] = (pipe.encoder.sessions.total_bytes(), pipe.encoder.prefix_cache.total_bytes())
            got += [pipe.chat(f"s{i}", "And the narrowest?", params=params).token_ids for i in range(args.sessions)]
            replies[name] = got
            print(f"{name}: sessions {held[name][0] / MiB:.1f} MiB, cache {held[name][1] / MiB:.1f} MiB", flush=True)
    if replies["with the cache"] != replies["without the cache"]:
        raise RuntimeError("the sessions answered differently with the cache: the run is void")
    text = render(args, held)
    figure(args.figure, held)
    write_section(args.out, text, SECTION, title="# The encoder's prefix cache")
    print(text)
    return 0


def render(args: argparse.Namespace, held: dict[str, tuple[int, int]]) -> str:
    alone = sum(held["without the cache"])
    lines = [SECTION, "",
             f"`.venv/bin/python -m benchmarks prefix-state-bytes --prompt-tokens {args.prompt_tokens} --sessions "
             f"{args.sessions}` ({time.strftime('%Y-%m-%d')}; onnx engines of the embedded default, in process): "
             f"{args.sessions} sessions open with one system prompt of about {args.prompt_tokens} tokens and a "
             "question each; bytes once every first turn has ended (idle sessions), fp32 state. The second turns "
             "of all sessions gave the same tokens with and without the cache.", "",
             "| | sessions' encoder state MiB | prefix cache MiB | total MiB | total / without |",
             "|---|---|---|---|---|"]
    for name, (sessions, cache) in held.items():
        lines.append(f"| {name} | {sessions / MiB:.1f} | {cache / MiB:.1f} | {(sessions + cache) / MiB:.1f} | "
                     f"{(sessions + cache) / alone:.2f}x |")
    lines += ["", "What one cached position costs in an entry, from the configs (fp32 state), and what an entry holds "
              "once whatever its length (the replay window's rows):", "",
              "| model | encoder stores B | hand-over rows B (global KV, index key, H19) | per position | "
              "per entry, once |", "|---|---|---|---|---|"]
    for name in ("mol2-small", "deepseek-v4.1-flash"):
        cost = per_token_bytes(PRESETS[name]())
        lines.append(f"| {name} | {cost['stores']:,.0f} | {cost['rows']:,.0f} | "
                     f"{(cost['stores'] + cost['rows']) / 1024:.1f} KiB | {cost['window'] / MiB:.1f} MiB |")
    lines += ["", f"![encoder state bytes, with and without the cache]({figure_link(args.figure, args.out)})"]
    return "\n".join(lines) + "\n"


def figure(path: Path, held: dict[str, tuple[int, int]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(held)
    sessions = [held[n][0] / MiB for n in names]
    cache = [held[n][1] / MiB for n in names]
    fig, ax = plt.subplots(figsize=(5.2, 3.4))
    ax.bar(names, sessions, label="sessions' own encoder state")
    ax.bar(names, cache, bottom=sessions, label="prefix cache (the prompt, once)")
    ax.set_ylabel("MiB, idle sessions")
    ax.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
