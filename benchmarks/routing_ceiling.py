"""How high can the adapter benchmark go with this encoder and these items? Reference classifiers, side by side.

    .venv/bin/python -m benchmarks routing-ceiling          # ~3 min on 2 CPU cores; writes docs/routing_ceiling.md

The article's goal (>= 97% on the adapter benchmark) assumes a 280 B-class encoder. Ours is 10 M parameters, so
before blaming the pointer head we measure what simpler readers of the same inputs reach on the same split
(adapter-routing train items -> the held-out 1,000-item benchmark), all fitted here in one run:

- linear probe on pooled H19 (the exact features MoL2 reads; 4 fixed classes, so easier than a pointer over
  descriptions);
- the same probe when the benchmark's own documents are also in training (5-fold over the benchmark items: an
  optimistic bound that removes the document shift between router train and benchmark);
- text-only shallow classifiers with no encoder: bag of tokens (our tokenizer) and hashed character 1-5-grams;
- the shipped MoL2 head (pointer over the four descriptions, first turns).

If every reader stalls at the same level, the items themselves (short windows of domain text, some of them prose
that fits no description better than another) and the encoder bound the benchmark, not the head.

    .venv/bin/python -m benchmarks routing-ceiling --natural   # ~15 min; the natural-request ceiling (issue #14)

`--natural` asks the same question of the natural-request benchmark: per-token H19 of every routing item is cached once
(`build_engines.routing.features`, the same items, histories and splits as the router stage,
`build_engines/routing/router_stage.py`), then readers of different poolings of H19 over the user turn (mean as served,
max, mean+max, last token, mean+last, a learned attention query) are fitted on the document-window and request-style
training items (first and later turns) and scored on both benchmarks, per class; the optimistic rows also train on 4/5
of the natural benchmark's own items (5-fold). It prints a markdown table and writes
`docs/figures/routing_natural_ceiling.json`.
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness import refuse_to_overwrite
from build_engines.routing.data import ADAPTER_DESCRIPTIONS, load_items
from build_engines.routing.features import POOLINGS, TokenFeatures, extract_h19_tokens
from build_engines.routing.train import extract_h19, model_digest, synthetic_histories
from ced.formats.checkpoint import load_checkpoint
from ced.model.network import EncoderEngine
from ced.routing.pointer_head import PointerHead, option_text
from ced.text.tokenizer import ChatTokenizer

LABELS = list(ADAPTER_DESCRIPTIONS)
HASH_DIM = 2**15


def fit_linear(x_train: torch.Tensor, y_train: torch.Tensor, steps: int = 1500, weight_decay: float = 1e-5,
               standardize: bool = True, lr: float = 1e-2) -> Callable[[torch.Tensor], torch.Tensor]:
    """Multinomial logistic regression, full batch Adam; returns a predictor. Dense features (H19) are standardised;
    sparse counts are not (standardising rare n-grams blows them up)."""
    mean, std = (x_train.mean(0), x_train.std(0) + 1e-3) if standardize else (torch.zeros(()), torch.ones(()))
    a = (x_train - mean) / std
    w = torch.zeros(a.shape[1], len(LABELS), requires_grad=True)
    b = torch.zeros(len(LABELS), requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=lr)
    for _ in range(steps):
        loss = F.cross_entropy(a @ w + b, y_train) + weight_decay * (w**2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    w, b = w.detach(), b.detach()
    return lambda x: (((x - mean) / std) @ w + b).argmax(-1)


def bag_of_tokens(tok: ChatTokenizer, texts: Sequence[str]) -> torch.Tensor:
    x = torch.zeros(len(texts), tok.vocab_size)
    for row, text in enumerate(texts):
        for t in tok.encode(text):
            x[row, t] += 1
    return torch.log1p(x)


def char_ngrams(texts: Sequence[str]) -> torch.Tensor:
    """Hashed counts of character 1..5-grams (crc32 into HASH_DIM buckets), log-scaled."""
    x = torch.zeros(len(texts), HASH_DIM)
    for row, text in enumerate(texts):
        for n in range(1, 6):
            for k in range(len(text) - n + 1):
                x[row, zlib.crc32(text[k : k + n].encode()) % HASH_DIM] += 1
    return torch.log1p(x)


def per_class(pred: torch.Tensor, y: torch.Tensor) -> list[float]:
    return [float((pred[y == c] == c).float().mean()) for c in range(len(LABELS))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("embedded/mol2-small"))
    p.add_argument("--routing", type=Path, default=Path("artifacts/routing"))
    p.add_argument("--cache", type=Path, default=Path("artifacts/router_cache"))
    p.add_argument("--out", type=Path, default=Path("docs/routing_ceiling.md"))
    p.add_argument("--natural", action="store_true", help="the natural-request ceiling instead (see the docstring)")
    p.add_argument("--force", action="store_true", help="overwrite the committed --out file (docs/routing_ceiling.md; "
                   "with --natural docs/figures/routing_natural_ceiling.json)")
    args = p.parse_args()
    written = args.out.parent / "figures" / "routing_natural_ceiling.json" if args.natural else args.out
    refuse_to_overwrite([written], args.force, "--out FILE")
    if args.natural:
        return natural_ceiling(args)
    if not (args.routing / "adapter.jsonl").exists():
        raise SystemExit(f"no routing items in {args.routing}: run `python -m build_engines.routing.data --data "
                         f"artifacts/data --out {args.routing}`")
    t_start = time.perf_counter()
    torch.manual_seed(0)
    tok = ChatTokenizer.load(args.model)
    net = load_checkpoint(args.model)
    encoder = EncoderEngine.from_state_dict(net.cfg, net.state_dict()).eval()
    embed = net.embed.weight.detach().float()
    digest = model_digest(args.model)
    items = load_items(args.routing, "adapter")
    train = [i for i in items if i["split"] == "train"]
    bench = [i for i in items if i["split"] == "test"]
    y_train = torch.tensor([LABELS.index(i["label"]) for i in train])
    y_bench = torch.tensor([LABELS.index(i["label"]) for i in bench])
    h_train = torch.from_numpy(extract_h19(encoder, tok, [i["query"] for i in train], args.cache, digest))
    h_bench = torch.from_numpy(extract_h19(encoder, tok, [i["query"] for i in bench], args.cache, digest))

    rows: list[tuple[str, float, list[float]]] = []

    def record(name: str, pred: torch.Tensor, y: torch.Tensor) -> None:
        acc = float((pred == y).float().mean())
        rows.append((name, acc, per_class(pred, y)))
        print(f"{name}: {100 * acc:.2f}%", flush=True)

    head = PointerHead.load(args.model / "router")
    with torch.no_grad():
        options = head.encode_options([embed[torch.tensor(tok.encode(option_text(ADAPTER_DESCRIPTIONS[label])))]
                                       for label in LABELS])
        record("MoL2 head (shipped; pointer over the 4 descriptions)", head.score(h_bench, options).argmax(-1), y_bench)
    record("linear probe on pooled H19 (4 fixed classes)", fit_linear(h_train, y_train)(h_bench), y_bench)
    folds = torch.randperm(len(bench), generator=torch.Generator().manual_seed(0)).chunk(5)
    pred = torch.empty_like(y_bench)
    for k, held in enumerate(folds):
        seen = torch.cat([f for j, f in enumerate(folds) if j != k])
        predict = fit_linear(torch.cat([h_train, h_bench[seen]]), torch.cat([y_train, y_bench[seen]]))
        pred[held] = predict(h_bench[held])
    record("linear probe on pooled H19, benchmark documents also in training (5-fold)", pred, y_bench)
    record("bag of tokens, logistic regression (no encoder)",
           fit_linear(bag_of_tokens(tok, [i["query"] for i in train]), y_train, 300, 1e-5, standardize=False,
                      lr=3e-3)(bag_of_tokens(tok, [i["query"] for i in bench])), y_bench)
    record("character 1-5-grams, logistic regression (no encoder)",
           fit_linear(char_ngrams([i["query"] for i in train]), y_train, 300, 1e-5, standardize=False,
                      lr=3e-3)(char_ngrams([i["query"] for i in bench])), y_bench)

    lines = [
        "# Routing ceiling: what reference classifiers reach on the adapter benchmark",
        "",
        f"Produced by `.venv/bin/python -m benchmarks routing-ceiling` in {time.perf_counter() - t_start:.0f} s "
        f"on this "
        f"machine (CPU). Train: {len(train)} adapter-routing items (router train split, from the domains' `val` "
        f"documents); test: the {len(bench)}-item held-out adapter benchmark (the domains' `test` documents). Every "
        "reader below sees exactly these items.",
        "",
        "| reader | benchmark accuracy % | " + " | ".join(LABELS) + " |",
        "|---|---|" + "---|" * len(LABELS),
    ]
    lines += [f"| {name} | {100 * acc:.2f} | " + " | ".join(f"{100 * c:.1f}" for c in classes) + " |"
              for name, acc, classes in rows]
    lines += [
        "",
        "The probes and shallow classifiers are fixed 4-way classifiers (they never read the descriptions), an easier "
        "task than the pointer's; the 5-fold row also trains on the benchmark's own documents. They bound what a "
        "better head alone could add on this encoder and this item set; see docs/routing.md for the reading.",
        "",
    ]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


class PooledReader(nn.Module):
    """A small nonlinear reader of per-token H19: mean pooling or `queries` learned attention queries (softmax over
    the turn's positions), then LayerNorm -> MLP -> 4 classes. Attention pooling is not chunk-composable as a
    fixed reduction (it needs the head's query at every position), so it bounds what a richer pooling could give."""

    def __init__(self, dim: int, pool: str, queries: int = 4, hidden: int = 256) -> None:
        super().__init__()
        self.pool = pool
        self.norm = nn.LayerNorm(dim)
        self.score = nn.Linear(dim, queries)
        width = dim * (queries if pool == "attn" else 1)
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, hidden), nn.GELU(),
                                 nn.Linear(hidden, len(LABELS)))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.pool == "mean":
            z = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        else:
            weights = self.score(self.norm(x)).masked_fill(~mask[..., None], float("-inf")).softmax(1)
            z = torch.einsum("btq,btd->bqd", weights, x).flatten(1)
        return self.mlp(z)


def fit_reader(pool: str, train: list[tuple[TokenFeatures, int]], y: torch.Tensor, seed: int,
               epochs: int = 3) -> Callable[[list[tuple[TokenFeatures, int]]], torch.Tensor]:
    """Minibatch AdamW on (token features, item) pairs; returns a predictor of such pairs."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = PooledReader(LABEL_DIM, pool)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    for _ in range(epochs):
        perm = torch.randperm(len(train), generator=g)
        for s in range(0, len(train), 256):
            idx = perm[s: s + 256].tolist()
            loss = F.cross_entropy(model(*_padded([train[i] for i in idx])), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()

    @torch.no_grad()
    def predict(pairs: list[tuple[TokenFeatures, int]]) -> torch.Tensor:
        return torch.cat([model(*_padded(pairs[s: s + 512])).argmax(-1) for s in range(0, len(pairs), 512)])
    return predict


LABEL_DIM = 256  # H19 width of the embedded default (checked when the features are loaded)
MAX_TOKENS = 96


def _padded(pairs: list[tuple[TokenFeatures, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of turns (last MAX_TOKENS positions each), right padded, with its validity mask."""
    T = min(MAX_TOKENS, max(int(tf.offsets[i + 1] - tf.offsets[i]) for tf, i in pairs))
    x = torch.zeros(len(pairs), T, LABEL_DIM)
    mask = torch.zeros(len(pairs), T, dtype=torch.bool)
    for row, (tf, i) in enumerate(pairs):
        v = tf.item(i)[-T:]
        x[row, : len(v)] = torch.from_numpy(v.astype("float32"))
        mask[row, : len(v)] = True
    return x, mask


def natural_ceiling(args: argparse.Namespace) -> int:
    """The natural-request ceiling (see the module docstring); prints the table, writes the figures' JSON."""
    import json

    from build_engines.routing.router_stage import cap  # the same caps as the study

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    tok = ChatTokenizer.load(args.model)
    net = load_checkpoint(args.model)
    encoder = EncoderEngine.from_state_dict(net.cfg, net.state_dict()).eval()
    embed = net.embed.weight.detach().float()
    if embed.shape[1] != LABEL_DIM:
        raise SystemExit(f"H19 width {embed.shape[1]} != {LABEL_DIM}")
    digest = model_digest(args.model)
    generic, adapter, request = (load_items(args.routing, n) for n in ("generic", "adapter", "requests"))
    base = {"train": cap([i for i in generic if i["split"] == "train"], 1500, 0)
            + cap([i for i in adapter if i["split"] == "train"], 100_000, 2),
            "test": cap([i for i in generic if i["split"] == "test"], 300, 1)
            + cap([i for i in adapter if i["split"] == "test"], 100_000, 3)}
    req = {s: cap([i for i in request if i["split"] == s], 100_000, 4) for s in base}
    feats: dict[tuple[str, str], TokenFeatures] = {}
    for split in base:  # the same histories as build_engines/routing/router_stage.py
        bq, rq = [i["query"] for i in base[split]], [i["query"] for i in req[split]]
        hist = (synthetic_histories(len(bq), bq, seed=0 if split == "train" else 1),
                synthetic_histories(len(rq), bq + rq, seed=10 if split == "train" else 11))
        for kind, qs, h in (("base", bq, None), ("req", rq, None), ("base_hist", bq, hist[0]),
                            ("req_hist", rq, hist[1])):
            feats[(split, kind)] = extract_h19_tokens(encoder, tok, qs, args.cache, digest, histories=h)
    doc_tr = [k for k, i in enumerate(base["train"]) if i["task"] == "adapter_routing"]
    doc_te = [k for k, i in enumerate(base["test"]) if i["task"] == "adapter_benchmark"]
    lab = LABELS.index
    y_doc_tr, y_doc_te = (torch.tensor([lab(base[s][k]["label"]) for k in ix])
                          for s, ix in (("train", doc_tr), ("test", doc_te)))
    y_req_tr, y_req_te = (torch.tensor([lab(i["label"]) for i in req[s]]) for s in ("train", "test"))
    train_pairs = [(feats[("train", kind)], i) for suffix in ("", "_hist")
                   for kind, ix in (("base" + suffix, doc_tr), ("req" + suffix, range(len(req["train"])))) for i in ix]
    y_train = torch.cat([y_doc_tr, y_req_tr, y_doc_tr, y_req_tr])
    benches = {"natural": (("test", "req"), range(len(req["test"])), y_req_te),
               "natural, later turn": (("test", "req_hist"), range(len(req["test"])), y_req_te),
               "document windows": (("test", "base"), doc_te, y_doc_te),
               "document windows, later turn": (("test", "base_hist"), doc_te, y_doc_te)}
    rows: list[dict] = []

    def record(name: str, preds: dict[str, torch.Tensor]) -> None:
        row = {"reader": name}
        for bench, (_, _, y) in benches.items():
            if bench in preds:
                row[bench] = float((preds[bench] == y).float().mean())
                row[bench + ":classes"] = per_class(preds[bench], y)
        rows.append(row)
        print(json.dumps(row), flush=True)

    head = PointerHead.load(args.model / "router")
    with torch.no_grad():
        options = head.encode_options([embed[torch.tensor(tok.encode(option_text(ADAPTER_DESCRIPTIONS[label])))]
                                       for label in LABELS])
        record("MoL2 head as shipped (mean pooling, pointer over the 4 descriptions)",
               {b: head.score(torch.from_numpy(feats[key].pool("mean"))[list(ix)], options).argmax(-1)
                for b, (key, ix, _) in benches.items()})
    for pool in POOLINGS:
        pooled = {key: torch.from_numpy(tf.pool(pool)) for key, tf in feats.items()}
        x = torch.cat([pooled[("train", "base")][doc_tr], pooled[("train", "req")],
                       pooled[("train", "base_hist")][doc_tr], pooled[("train", "req_hist")]])
        predict = fit_linear(x, y_train, steps=600, weight_decay=1e-4)
        record(f"linear probe, {pool} pooling",
               {b: predict(pooled[key][list(ix)]) for b, (key, ix, _) in benches.items()})
        if pool in ("mean", "meanmax"):
            nat, pred = pooled[("test", "req")], torch.empty_like(y_req_te)
            for held in torch.randperm(len(y_req_te), generator=torch.Generator().manual_seed(0)).chunk(5):
                seen = torch.tensor(sorted(set(range(len(y_req_te))) - set(held.tolist())))
                pred[held] = fit_linear(torch.cat([x, nat[seen].repeat(5, 1)]),
                                        torch.cat([y_train, y_req_te[seen].repeat(5)]), steps=600,
                                        weight_decay=1e-4)(nat[held])
            record(f"linear probe, {pool} pooling, 4/5 of the natural benchmark also in training (5-fold)",
                   {"natural": pred})
    for pool in ("mean", "attn"):
        for seed in range(3):
            predict = fit_reader(pool, train_pairs, y_train, seed)
            record(f"MLP reader, {'mean pooling' if pool == 'mean' else '4 learned attention queries'}, seed {seed}",
                   {b: predict([(feats[key], i) for i in ix]) for b, (key, ix, _) in benches.items()})
        nat, pred = feats[("test", "req")], torch.empty_like(y_req_te)
        for held in torch.randperm(len(y_req_te), generator=torch.Generator().manual_seed(0)).chunk(5):
            seen = sorted(set(range(len(y_req_te))) - set(held.tolist()))
            extra = [(nat, i) for i in seen] * 5
            predict = fit_reader(pool, train_pairs + extra, torch.cat([y_train, y_req_te[seen].repeat(5)]), 0)
            pred[held] = predict([(nat, i) for i in held.tolist()])
        record(f"MLP reader, {pool} pooling, 4/5 of the natural benchmark also in training (5-fold)", {"natural": pred})
    texts = {"natural": [i["query"] for i in req["test"]],
             "document windows": [base["test"][k]["query"] for k in doc_te]}
    bag_train = bag_of_tokens(tok, [base["train"][k]["query"] for k in doc_tr] + [i["query"] for i in req["train"]])
    predict = fit_linear(bag_train, torch.cat([y_doc_tr, y_req_tr]), 300, 1e-5, standardize=False, lr=3e-3)
    record("bag of tokens, logistic regression (text only, no encoder; diagnostic)",
           {b: predict(bag_of_tokens(tok, t)) for b, t in texts.items()})
    out = args.out.parent / "figures" / "routing_natural_ceiling.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "labels": LABELS, "wall_s": time.perf_counter() - t_start}, indent=1)
                   + "\n")
    cols = list(benches)
    print("| reader | " + " | ".join(cols) + " | natural per class (" + ", ".join(LABELS) + ") |")
    print("|---|" + "---|" * (len(cols) + 1))
    for row in rows:
        print(f"| {row['reader']} | " + " | ".join(f"{100 * row[c]:.1f}" if c in row else "-" for c in cols) + " | "
              + " / ".join(f"{100 * v:.0f}" for v in row["natural:classes"]) + " |")
    print(f"({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
