"""The router stage (`python -m build_engines router`): train and evaluate the MoL2 router on the embedded default;
write docs/routing.md and the trained head.

    .venv/bin/python -m build_engines router            # the recipes x 3 seeds, data-scaling sweep, final head
    .venv/bin/python -m build_engines router --final-only --steps 1200 --final-seeds 3   # the shipped recipe (V) x 3
                                                        # seeds at full length, R beside it; seed 0 is shipped

The study follows the article: generic pick-one questions rewritten from labelled sets (each with its own candidate
set) plus adapter-domain user turns; recipe A = generic only, B = mixed, C = staged (generic, then adapter); the
held-out adapter benchmark and per-source generic test accuracy; a sweep over the amount of adapter data. Recipe H
is ours: B plus a copy of every training item encoded as a later turn (after a synthetic conversation prefix), since
serving routes later turns on H19 computed with the history in the encoder. Recipe R is H plus request-style items
(what users ask each adapter, `build_engines.routing.requests`), again as first and later turns. Recipe V (shipped)
is R with varied option sets (other domains' descriptions beside the four adapters, and requests about those
domains answered by their descriptions, `build_engines.routing.option_domains`), so that the head reads a
description and routes to an adapter it never saw (the zero-shot check, `zero_shot_sets`).
Every head is evaluated on two adapter benchmarks, the document-window benchmark and the natural-request benchmark
(sources and phrasings disjoint from training, see `requests`), first turns (the article's setting) and the same
items as later turns, per class and with a confusion matrix. The head of recipe V (seed 0) becomes the embedded
default's router (`<model>/router/`).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from build_engines.committed import refuse_to_overwrite  # noqa: E402
from build_engines.data.corpora import reader  # noqa: E402
from build_engines.routing.data import ADAPTER_DESCRIPTIONS, FILES, load_items, write_routing_data  # noqa: E402
from build_engines.routing.option_domains import OPTION_BENCHMARK_TASK, OPTION_TASK, vary_options  # noqa: E402
from build_engines.routing.report import adapter_scores, confusion_table, mean_std  # noqa: E402
from build_engines.routing.requests import (  # noqa: E402
    ZERO_SHOT_ADAPTER,
    ZERO_SHOT_DESCRIPTION,
    ZERO_SHOT_KIND,
    ZERO_SHOT_REQUESTS,
    ZERO_SHOT_SOURCE,
    zero_shot_requests,
)
from build_engines.routing.train import (  # noqa: E402
    TaskSet,
    accuracy,
    build_task_sets,
    extract_h19,
    model_digest,
    new_head,
    predictions,
    synthetic_histories,
    train_head,
    write_json,
)
from ced.formats.checkpoint import load_checkpoint  # noqa: E402
from ced.model.network import EncoderEngine  # noqa: E402
from ced.text.tokenizer import ChatTokenizer  # noqa: E402

ADAPTER_TRAIN, ADAPTER_BENCH = "adapter_routing", "adapter_benchmark"
ADAPTER_BENCH_HIST = "adapter_benchmark_later_turn"
REQUEST_TRAIN, REQUEST_BENCH = "request_routing", "request_benchmark"
REQUEST_BENCH_HIST = "request_benchmark_later_turn"
BENCHMARKS = ((ADAPTER_BENCH, ADAPTER_BENCH, "test"), (ADAPTER_BENCH_HIST, ADAPTER_BENCH, "test_hist"),
              (REQUEST_BENCH, REQUEST_BENCH, "test"), (REQUEST_BENCH_HIST, REQUEST_BENCH, "test_hist"))
RECIPE_NAMES = {"A": "generic only", "B": "mixed", "C": "staged", "H": "mixed + later-turn copies",
                "R": "H + request-style items", "V": "R with varied options + option-domain items"}
SHIPPED_RECIPE = "V"
LABELS = list(ADAPTER_DESCRIPTIONS)
NOTES_HEADING = "## Reading the results"
SHIPPED_BEGIN, SHIPPED_END = "<!-- shipped-head:begin -->", "<!-- shipped-head:end -->"


ZERO_SHOT, NATURAL_FIVE = "zero_shot", "natural_requests_five_adapters"


def zero_shot_sets(args: argparse.Namespace, encoder, tok, digest: str,  # type: ignore[no-untyped-def]
                   natural: list[dict]) -> dict[str, TaskSet]:
    """The zero-shot check (as `benchmarks/zero_shot_adapter.py` makes it through the served router, here on the head
    alone, for every seed): the fifth adapter's requests and the natural-request benchmark, each with the four
    adapter descriptions plus the fifth's as options. Empty when the plays' source is not prepared."""
    if ZERO_SHOT_SOURCE not in reader.sources(args.data):
        return {}
    five = list(ADAPTER_DESCRIPTIONS.values()) + [ZERO_SHOT_DESCRIPTION]
    answer = {**ADAPTER_DESCRIPTIONS, ZERO_SHOT_ADAPTER: ZERO_SHOT_DESCRIPTION}
    out = {}
    requests = zero_shot_requests(args.data, ZERO_SHOT_SOURCE, ZERO_SHOT_KIND, ZERO_SHOT_ADAPTER, ZERO_SHOT_REQUESTS)
    for name, items in ((ZERO_SHOT, requests), (NATURAL_FIVE, natural)):
        rows = [{**i, "task": name, "options": five, "answer": five.index(answer[i["label"]])} for i in items]
        features = extract_h19(encoder, tok, [i["query"] for i in rows], args.cache, digest)
        out[name] = build_task_sets(rows, features, tok)[name]
    return out


def cap(items: list[dict], per_task: int, seed: int) -> list[dict]:
    """At most `per_task` items of each task (seeded), so no task dominates and extraction stays short."""
    rng = random.Random(seed)
    by_task: dict[str, list[dict]] = {}
    for it in items:
        by_task.setdefault(it["task"], []).append(it)
    out = []
    for task in sorted(by_task):
        rows = by_task[task]
        out.extend(rows if len(rows) <= per_task else rng.sample(rows, per_task))
    return out


def limit(ts: TaskSet, n: int, seed: int) -> TaskSet:
    g = torch.Generator().manual_seed(seed)
    return ts if n >= len(ts) else ts.subset(torch.randperm(len(ts), generator=g)[:n])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("embedded/mol2-small"))
    p.add_argument("--data", type=Path, default=Path("artifacts/data"))
    p.add_argument("--routing", type=Path, default=Path("artifacts/routing"))
    p.add_argument("--cache", type=Path, default=Path("artifacts/router_cache"))
    p.add_argument("--out", type=Path, default=Path("docs/routing.md"))
    p.add_argument("--train-per-task", type=int, default=1500)
    p.add_argument("--test-per-task", type=int, default=300)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=256, help="routing items per head step")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--sweep-seeds", type=int, default=1)
    p.add_argument("--sweep", default="0,50,250,1000,4000")
    p.add_argument("--final-only", action="store_true", help="skip the study: train only the shipped recipe (V) for "
                   "--steps, seeds 0..--final-seeds-1, ship seed 0")
    p.add_argument("--final-seeds", type=int, default=1,
                   help="with --final-only: seeds of the shipped recipe to train and report (seed 0 is shipped)")
    p.add_argument("--recipes", default=",".join(RECIPE_NAMES), help="recipes of the study (comma separated)")
    p.add_argument("--compare-recipes", default="R",
                   help="with --final-only: recipes also trained (same seeds, same data) and "
                   "reported beside the shipped one (comma separated; empty for none)")
    p.add_argument("--no-save", action="store_true", help="do not write the head into the model (experiments)")
    p.add_argument("--adapter-cap", type=int, default=100_000,
                   help="at most this many adapter items per split (smoke runs)")
    p.add_argument("--force", action="store_true",
                   help="overwrite the committed outputs: the router head and manifest in --model "
                   "(unless --no-save), --out (docs/routing.md) and its figures")
    args = p.parse_args(argv)
    figures = args.out.parent / "figures"
    if args.final_only:
        written = [] if args.no_save else [args.out, figures / "routing_final_head.json"]
    else:
        written = [args.out,
                   *(figures / f for f in ("routing_results.json", "routing_recipes.png", "routing_scaling.png"))]
    if not args.no_save and (args.final_only or SHIPPED_RECIPE in args.recipes.split(",")):
        written += [args.model / "router", args.model / "manifest.json"]
    refuse_to_overwrite(written, args.force, "--no-save" if args.final_only
                        else "--out FILE and --no-save (or --model DIR)")
    t_start = time.perf_counter()
    if not all((args.routing / f"{name}.jsonl").exists() for name in FILES):
        write_routing_data(args.data, args.routing)
    tok = ChatTokenizer.load(args.model)
    net = load_checkpoint(args.model)
    encoder = EncoderEngine.from_state_dict(net.cfg, net.state_dict()).eval()
    embed = net.embed.weight.detach().float()
    digest = model_digest(args.model)
    del net

    generic = load_items(args.routing, "generic")
    adapter = load_items(args.routing, "adapter")
    request = load_items(args.routing, "requests")
    option = load_items(args.routing, "options")
    base_splits = {
        "train": cap([i for i in generic if i["split"] == "train"], args.train_per_task, 0)
        + cap([i for i in adapter if i["split"] == "train"], args.adapter_cap, 2),
        "test": cap([i for i in generic if i["split"] == "test"], args.test_per_task, 1)
        + cap([i for i in adapter if i["split"] == "test"], args.adapter_cap, 3),
    }
    request_splits = {split: cap([i for i in request if i["split"] == split], args.adapter_cap, 4)
                      for split in base_splits}
    option_splits = {split: [i for i in option if i["split"] == split] for split in base_splits}
    splits = {split: base_splits[split] + request_splits[split] + option_splits[split] for split in base_splits}
    sets = {}
    for split in splits:
        # Extracted in two parts so that regenerating the request items leaves the cached generic/document features
        # valid: base histories come from the base queries as before; request items get their own seeded
        # histories drawn from every query of the split (any domain, any kind).
        base_q = [i["query"] for i in base_splits[split]]
        req_q = [i["query"] for i in request_splits[split]]
        opt_q = [i["query"] for i in option_splits[split]]
        first = [extract_h19(encoder, tok, q, args.cache, digest) for q in (base_q, req_q, opt_q)]
        histories = (synthetic_histories(len(base_q), base_q, seed=0 if split == "train" else 1),
                     synthetic_histories(len(req_q), base_q + req_q, seed=10 if split == "train" else 11),
                     synthetic_histories(len(opt_q), base_q, seed=20 if split == "train" else 21))
        later = [extract_h19(encoder, tok, q, args.cache, digest, histories=h)
                 for q, h in zip((base_q, req_q, opt_q), histories)]
        sets[split] = build_task_sets(splits[split], np.concatenate(first), tok)
        sets[split + "_hist"] = build_task_sets(splits[split], np.concatenate(later), tok)
        if split == "train":  # recipe V: the adapter and request items with option-domain descriptions added
            varied = vary_options(splits[split], seed=0)
            sets["train_varied"] = build_task_sets(varied, np.concatenate(first), tok)
            sets["train_varied_hist"] = build_task_sets(varied, np.concatenate(later), tok)
    generic_tasks = sorted(t for t in sets["train"] if not t.startswith(("adapter", "request", "option")))
    zero_shot = zero_shot_sets(args, encoder, tok, digest,
                               [i for i in request_splits["test"] if i["task"] == REQUEST_BENCH])
    print(f"items: train {sum(len(s) for s in sets['train'].values())}, test "
          f"{sum(len(s) for s in sets['test'].values())}; H19 ready after {time.perf_counter() - t_start:.0f} s")

    label_of = {d: a for a, d in ADAPTER_DESCRIPTIONS.items()}
    expected = {task: [i["label"] for i in splits["test"] if i["task"] == task]
                for task in (ADAPTER_BENCH, REQUEST_BENCH)}

    def evaluate(head) -> dict:  # type: ignore[no-untyped-def]
        res: dict = {t: accuracy(head, embed, sets["test"][t]) for t in generic_tasks}
        res["generic_mean"] = statistics.mean(res[t] for t in generic_tasks)
        res["generic_mean_later_turn"] = statistics.mean(accuracy(head, embed, sets["test_hist"][t])
                                                         for t in generic_tasks)
        res[OPTION_BENCHMARK_TASK] = accuracy(head, embed, sets["test"][OPTION_BENCHMARK_TASK])
        for name, ts in zero_shot.items():  # never trained on: the fifth adapter's description beside the four
            res[name] = accuracy(head, embed, ts)
        for name, task, split in BENCHMARKS:
            ts = sets[split][task]
            chosen = [label_of[ts.descriptions[k]] for k in predictions(head, embed, ts).tolist()]
            res.update(adapter_scores(name, chosen, expected[task], LABELS))
        return res

    def run(recipe: str, n_adapter: int, seed: int) -> tuple[dict[str, float], object]:
        gen = [sets["train"][t] for t in generic_tasks]
        ad = limit(sets["train"][ADAPTER_TRAIN], n_adapter, seed)
        head = new_head(embed.shape[1], seed)
        if recipe == "A" or n_adapter == 0:
            stages, steps = [gen], [args.steps]
        elif recipe == "B":
            stages, steps = [gen + [ad]], [args.steps]
        elif recipe in ("H", "R", "V"):  # B plus every training item again as a later turn (R: and the request items;
            # V: R with option-domain descriptions among the adapter and request items' options, and option-domain
            # items)
            first, later = ("train_varied", "train_varied_hist") if recipe == "V" else ("train", "train_hist")
            ad = limit(sets[first][ADAPTER_TRAIN], n_adapter, seed)
            gen_hist = [sets["train_hist"][t] for t in generic_tasks]
            ad_hist = limit(sets[later][ADAPTER_TRAIN], n_adapter, seed)
            stage = gen + [ad] + gen_hist + [ad_hist]
            if recipe in ("R", "V"):
                stage += [sets[first][REQUEST_TRAIN], sets[later][REQUEST_TRAIN]]
            if recipe == "V":
                stage += [sets["train"][OPTION_TASK], sets["train_hist"][OPTION_TASK]]
            stages, steps = [stage], [args.steps]
        else:  # C: staged
            stages, steps = [gen, [ad]], [args.steps * 2 // 3, args.steps - args.steps * 2 // 3]
        t0 = time.perf_counter()
        train_head(head, embed, stages, steps, batch=args.batch, seed=seed, progress=False)
        res = evaluate(head)
        res["train_s"] = time.perf_counter() - t0
        print(f"recipe {recipe} n_adapter {n_adapter} seed {seed}: document windows {res[ADAPTER_BENCH]:.4f} (later "
              f"turn {res[ADAPTER_BENCH_HIST]:.4f}), natural requests {res[REQUEST_BENCH]:.4f} (later turn "
              f"{res[REQUEST_BENCH_HIST]:.4f}), generic mean {res['generic_mean']:.4f}, option domains "
              f"{res[OPTION_BENCHMARK_TASK]:.4f}, "
              + "".join(f"{name} {res[name]:.4f}, " for name in zero_shot) + f"({res['train_s']:.0f} s)", flush=True)
        return res, head

    n_all = len(sets["train"][ADAPTER_TRAIN])
    if args.final_only:
        per_seed = []
        for seed in range(args.final_seeds):
            res, head = run(SHIPPED_RECIPE, n_all, seed)
            per_seed.append(res)
            if seed == 0:
                shipped = head
            for name in (ADAPTER_BENCH, REQUEST_BENCH):
                per_class = ", ".join(f"{label} {100 * res[f'{name}:{label}']:.1f}%" for label in LABELS)
                print(f"  seed {seed} {name}: {100 * res[name]:.2f}% ({per_class}), as later turns "
                      f"{100 * res[name + '_later_turn']:.2f}%")
        if not args.no_save:
            shipped.save(args.model / "router")
            register_router_files(args.model)
        compare = {recipe: [run(recipe, n_all, seed)[0] for seed in range(args.final_seeds)]
                   for recipe in [r for r in args.compare_recipes.split(",") if r and r != SHIPPED_RECIPE]}
        summary = {"recipe": SHIPPED_RECIPE, "steps": args.steps, "seeds": list(range(args.final_seeds)),
                   "shipped_seed": 0, "results": per_seed[0], "per_seed": per_seed, "compare": compare,
                   "wall_s": time.perf_counter() - t_start}
        print(f"final head (recipe {SHIPPED_RECIPE}, {args.steps} steps, seeds {summary['seeds']}): natural requests "
              f"{mean_std([r[REQUEST_BENCH] for r in per_seed])}% (later turns "
              f"{mean_std([r[REQUEST_BENCH_HIST] for r in per_seed])}%), document windows "
              f"{mean_std([r[ADAPTER_BENCH] for r in per_seed])}% (later turns "
              f"{mean_std([r[ADAPTER_BENCH_HIST] for r in per_seed])}%), generic mean "
              f"{mean_std([r['generic_mean'] for r in per_seed])}%; "
              + ("not saved (--no-save)" if args.no_save else f"seed 0 saved to {args.model / 'router'}"))
        if not args.no_save:
            write_json(args.out.parent / "figures" / "routing_final_head.json", summary)
            write_shipped_section(args.out, summary, sys.argv[1:])
        return 0
    recipes: dict[str, list[dict[str, float]]] = {}
    final_head = None
    for recipe in [r for r in args.recipes.split(",") if r]:
        recipes[recipe] = []
        for seed in range(args.seeds):
            res, head = run(recipe, 0 if recipe == "A" else n_all, seed)
            recipes[recipe].append(res)
            if recipe == SHIPPED_RECIPE and seed == 0:
                final_head = head
    sweep: dict[int, list[float]] = {}
    for n in [int(x) for x in args.sweep.split(",") if x]:
        n = min(n, n_all)
        sweep[n] = [run("B", n, seed)[0][ADAPTER_BENCH] for seed in range(args.sweep_seeds)]
    if final_head is not None and not args.no_save:
        final_head.save(args.model / "router")
        register_router_files(args.model)
    results = {"recipes": recipes, "sweep": {str(k): v for k, v in sweep.items()}, "generic_tasks": generic_tasks,
               "items": {s: {t: len(ts) for t, ts in v.items()} for s, v in sets.items()},
               "wall_s": time.perf_counter() - t_start}
    write_json(args.out.parent / "figures" / "routing_results.json", results)
    write_report(args, results, sys.argv[1:])
    return 0


def register_router_files(model: Path) -> None:
    """Add the router head's files to the embedded default's manifest (hashes checked by the tests)."""
    import json

    path = model / "manifest.json"
    manifest = json.loads(path.read_text())
    for f in sorted((model / "router").iterdir()):
        manifest["files_sha256"][f"router/{f.name}"] = hashlib.sha256(f.read_bytes()).hexdigest()
    manifest["router_command"] = "python -m build_engines router " + " ".join(sys.argv[1:])
    path.write_text(json.dumps(manifest, indent=2) + "\n")


_ms = mean_std


def shipped_lines(summary: dict, argv: list[str]) -> list[str]:
    """The shipped recipe's section: both benchmarks per seed, first and later turns, per class, confusion matrices
    of the shipped seed."""
    per_seed, labels = summary["per_seed"], LABELS
    lines = [
        SHIPPED_BEGIN,
        f"## The shipped head: natural requests beside document windows (recipe {summary['recipe']}, "
        f"{summary['steps']} steps, seeds {summary['seeds']}; seed {summary['shipped_seed']} shipped)",
        "",
        f"Produced by `.venv/bin/python -m build_engines router {' '.join(argv)}` in {summary['wall_s'] / 60:.1f} min "
        "(H19 features cached). Natural-request benchmark: `request_benchmark` in `artifacts/routing/requests.jsonl`; "
        "document-window benchmark: `adapter_benchmark` in `adapter.jsonl`. Later turn: the same items encoded after a "
        "seeded synthetic conversation prefix from test-split texts.",
        "",
        "| seed | natural requests | natural requests, later turn | document windows | document windows, later turn | "
        "generic mean |",
        "|---|---|---|---|---|---|",
    ]
    for seed, r in zip(summary["seeds"], per_seed):
        lines.append(f"| {seed} | {100 * r[REQUEST_BENCH]:.2f} | {100 * r[REQUEST_BENCH_HIST]:.2f} | "
                     f"{100 * r[ADAPTER_BENCH]:.2f} | {100 * r[ADAPTER_BENCH_HIST]:.2f} | "
                     f"{100 * r['generic_mean']:.2f} |")
    lines.append("| mean ± std | " + " | ".join(_ms([r[k] for r in per_seed])
                                                for k in (REQUEST_BENCH, REQUEST_BENCH_HIST, ADAPTER_BENCH,
                                                          ADAPTER_BENCH_HIST, "generic_mean")) + " |")
    if ZERO_SHOT in per_seed[0]:
        lines += ["", f"Never trained on, per seed: the zero-shot fifth adapter `{ZERO_SHOT_ADAPTER}` "
                  f"({ZERO_SHOT_REQUESTS} requests about Shakespeare's plays, `requests.zero_shot_requests`) with its "
                  "description beside the four adapters; the natural-request benchmark with those five options; the "
                  "option-domain benchmark (`option_benchmark` in `options.jsonl`). `benchmarks/zero_shot_adapter.py` "
                  "repeats the first two through the served router with the adapter registered by `adapter_admin`.", "",
                  "| seed | zero-shot fifth adapter | natural requests, five adapters | option domains |",
                  "|---|---|---|---|"]
        for seed, r in zip(summary["seeds"], per_seed):
            lines.append(f"| {seed} | {100 * r[ZERO_SHOT]:.2f} | {100 * r[NATURAL_FIVE]:.2f} | "
                         f"{100 * r[OPTION_BENCHMARK_TASK]:.2f} |")
        lines.append("| mean ± std | " + " | ".join(_ms([r[k] for r in per_seed])
                                                    for k in (ZERO_SHOT, NATURAL_FIVE, OPTION_BENCHMARK_TASK)) + " |")
    if summary.get("compare"):
        keys = [(REQUEST_BENCH, "natural requests"), (ADAPTER_BENCH, "document windows"),
                ("generic_mean", "generic mean")]
        keys += [(k, t)
                 for k, t in ((ZERO_SHOT, "zero-shot fifth adapter"), (NATURAL_FIVE, "natural requests, five adapters"),
                                     (OPTION_BENCHMARK_TASK, "option domains")) if k in per_seed[0]]
        lines += ["", "Beside the other recipes, trained in the same run on the same items and seeds (mean ± std, %):",
                  "", "| recipe | " + " | ".join(t for _, t in keys) + " |", "|---|" + "---|" * len(keys)]
        for recipe, runs in [(summary["recipe"], per_seed), *summary["compare"].items()]:
            lines.append(f"| {recipe}: {RECIPE_NAMES[recipe]} | "
                         + " | ".join(_ms([r[k] for r in runs]) for k, _ in keys) + " |")
    lines += ["", "Per class, mean ± std over the seeds, % (first turn / later turn):", "",
              "| benchmark | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for name, title in ((REQUEST_BENCH, "natural requests"), (ADAPTER_BENCH, "document windows")):
        lines.append(f"| {title} | " + " | ".join(f"{_ms([r[f'{name}:{c}'] for r in per_seed])} / "
                                                  f"{_ms([r[f'{name}_later_turn:{c}'] for r in per_seed])}"
                                                  for c in labels) + " |")
    shipped = per_seed[summary["seeds"].index(summary["shipped_seed"])]
    for name, title in ((REQUEST_BENCH, "natural requests, first turn"),
                        (REQUEST_BENCH_HIST, "natural requests, later turn"),
                        (ADAPTER_BENCH, "document windows, first turn"),
                        (ADAPTER_BENCH_HIST, "document windows, later turn")):
        lines += ["", f"Confusion matrix of the shipped head, {title} ({100 * shipped[name]:.2f}%):", ""]
        lines += confusion_table(shipped[f"{name}:confusion"], labels)
    return lines + ["", SHIPPED_END, ""]


def write_shipped_section(out: Path, summary: dict, argv: list[str]) -> None:
    """Replace (or insert before the hand-written notes) the shipped-head section of the report."""
    section = "\n".join(shipped_lines(summary, argv))
    text = out.read_text() if out.exists() else ""
    if SHIPPED_BEGIN in text and SHIPPED_END in text:
        head, rest = text.split(SHIPPED_BEGIN, 1)
        text = head + section + rest.split(SHIPPED_END, 1)[1].lstrip("\n")
    elif NOTES_HEADING in text:
        head, rest = text.split(NOTES_HEADING, 1)
        text = head + section + "\n" + NOTES_HEADING + rest
    else:
        text = text + "\n" + section
    out.write_text(text)
    print(section)


def write_report(args: argparse.Namespace, results: dict, argv: list[str]) -> None:
    recipes, sweep, tasks = results["recipes"], results["sweep"], results["generic_tasks"]
    fig_dir = args.out.parent / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
    names = list(recipes)
    x = list(range(len(names)))
    for axis, (first, later, title) in zip(ax, (("adapter_benchmark", ADAPTER_BENCH_HIST,
                                                 "adapter benchmark accuracy by recipe"),
                                                ("generic_mean", "generic_mean_later_turn",
                                                 "generic test accuracy (mean over sources)"))):
        for offset, key, label in ((-0.2, first, "first turn"), (0.2, later, "later turn")):
            axis.bar([i + offset for i in x], [100 * statistics.mean(r[key] for r in recipes[n]) for n in names],
                     width=0.4, label=label, yerr=[100 * statistics.pstdev(r[key] for r in recipes[n]) for n in names],
                     capsize=4)
        axis.set(title=title, ylabel="%", ylim=(0, 100), xticks=x, xticklabels=names)
        axis.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(fig_dir / "routing_recipes.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ns = sorted(int(k) for k in sweep)
    ax.errorbar([max(n, 1) for n in ns], [100 * statistics.mean(sweep[str(n)]) for n in ns],
                yerr=[100 * statistics.pstdev(sweep[str(n)]) for n in ns], marker="o", capsize=3)
    ax.set(xscale="log", xlabel="adapter-domain training items (0 plotted at 1)", ylabel="adapter benchmark %",
           title="data scaling (recipe B)")
    fig.tight_layout()
    fig.savefig(fig_dir / "routing_scaling.png", dpi=110)
    plt.close(fig)
    lines = [
        "# MoL2 routing: accuracy by training recipe and data scaling",
        "",
        f"Produced by `.venv/bin/python -m build_engines router {' '.join(argv)}` in {results['wall_s'] / 60:.1f} min "
        f"on this machine (CPU). Model: `{args.model}` (H19 = last encoder layer, pooled over the user turn). Items "
        f"used (after a per-task cap): {results['items']}.",
        "",
        "## Accuracy by recipe (analog of the article's Figure 11); mean ± std over seeds, %",
        "",
        "| recipe | natural requests | natural requests, later turn | document windows (adapter benchmark) | document "
        "windows, later turn | generic mean | generic mean, later turn | " + " | ".join(tasks) + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(tasks),
    ]
    for n in names:
        rs = recipes[n]
        lines.append(f"| {n} | {_ms([r[REQUEST_BENCH] for r in rs])} | {_ms([r[REQUEST_BENCH_HIST] for r in rs])} | "
                     f"{_ms([r['adapter_benchmark'] for r in rs])} | {_ms([r[ADAPTER_BENCH_HIST] for r in rs])} | "
                     f"{_ms([r['generic_mean'] for r in rs])} | {_ms([r['generic_mean_later_turn'] for r in rs])} "
                     "| " + " | ".join(_ms([r[t] for r in rs]) for t in tasks) + " |")
    classes = LABELS
    lines += [
        "",
        "; ".join(f"{n} = {d}" for n, d in RECIPE_NAMES.items())
        + " (H: every training item once as a first turn and once after a seeded synthetic conversation prefix of 1-2 "
        "exchanges drawn from other items of the split). \"Later turn\": the same test items encoded after such a "
        "prefix (test-split texts, seeded), which is how serving routes every turn after the first.",
        "",
        "Per class on the document-window benchmark (first turn / later turn), %:",
        "",
        "| recipe | " + " | ".join(classes) + " |",
        "|---|" + "---|" * len(classes),
    ]
    for n in names:
        rs = recipes[n]
        lines.append(f"| {n} | " + " | ".join(f"{_ms([r[ADAPTER_BENCH + ':' + c] for r in rs])} / "
                                              f"{_ms([r[ADAPTER_BENCH_HIST + ':' + c] for r in rs])}" for c in classes)
                     + " |")
    lines += ["", "Per class on the natural-request benchmark (first turn / later turn), %:", "",
              "| recipe | " + " | ".join(classes) + " |", "|---|" + "---|" * len(classes)]
    for n in names:
        rs = recipes[n]
        lines.append(f"| {n} | " + " | ".join(f"{_ms([r[REQUEST_BENCH + ':' + c] for r in rs])} / "
                                              f"{_ms([r[REQUEST_BENCH_HIST + ':' + c] for r in rs])}" for c in classes)
                     + " |")
    lines += [
        "",
        "",
        "![recipes](figures/routing_recipes.png)",
        "",
        "## Data scaling: adapter-domain items added to the full generic set (analog of the article's Figure 13, group "
        "B); recipe B, %",
        "",
        "| adapter items | " + " | ".join(str(n) for n in ns) + " |",
        "|---|" + "---|" * len(ns),
        "| adapter benchmark | " + " | ".join(_ms(sweep[str(n)]) for n in ns) + " |",
        "",
        "![scaling](figures/routing_scaling.png)",
        "",
    ]
    notes = ""  # the shipped-head section and the hand-written analysis below the generated part survive re-runs
    old = args.out.read_text() if args.out.exists() else ""
    for marker in (SHIPPED_BEGIN, NOTES_HEADING):
        if marker in old:
            notes = old[old.index(marker):]
            break
    args.out.write_text("\n".join(lines) + "\n" + notes)
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
