"""Train the DSpark drafter of a small model by self-distillation, and ship it as the model's `drafter/` sidecar.

`python -m build_engines.training.drafter_stage --model embedded/mol2-small --work artifacts/train/drafter --force`

Why self-distillation: a drafter is only useful when it guesses what *this* target says next, so its labels are the
target's own greedy continuations, not corpus text. And since the drafter reads decoder layers (whose hidden states
change with the adapter), the replies are generated under the base and under every bundled adapter.

1. Prompts: user requests per adapter domain (`routing.requests`: train documents and the train phrasing bank for
   training, test documents and the benchmark bank for evaluation, so no evaluation prompt is a training one) plus
   plain chat (movie-dialogue utterances, train / test dialogues), rendered with the model's chat format exactly as
   the serving path renders a one-message conversation.
2. Replies: greedy, at most `max_new` tokens, cut after the end-of-turn token, generated with incremental decoding in
   batches of equal-length prompts (every row of a batch runs under its own adapter). Then one teacher-forced pass
   per batch reads the target layers' inputs (`target_hidden`). Both are cached under `--work`, keyed by a hash of
   the model, its adapters, the prepared data and these settings.
3. Training anchors: positions t whose next token t+1 is a reply token; the drafter reads the newest `window_size`
   rows up to t and last_token = token t+1, and is scored against tokens t+2..t+1+block. Loss: cross-entropy of every
   draft position with the true previous token forced (`forced=labels`), plus a binary cross-entropy that teaches the
   confidence score (read as a logit) whether that position's argmax is right.
4. Evaluation on the held-out prompts, per adapter: mean accepted drafts per block (leading drafts equal to the
   target's continuation), also with the block cut at the first draft whose sigmoid(confidence) < 0.5, against the
   prompt-lookup n-gram drafter the server ships and the untrained drafter.
5. Output: `save_drafter` into the model directory and a `drafter` record (plus hashes and size) in its manifest.

Resumable: the training state is saved every `checkpoint_every` steps and a re-run continues from it; a model whose
drafter and manifest record exist is skipped unless `--force` (which the committed default needs anyway).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import shlex
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from build_engines.committed import refuse_to_overwrite
from build_engines.training.train import lr_at, save_atomic
from ced.formats.drafter_files import DRAFTER_DIR, WEIGHTS_FILE, load_drafter, save_drafter
from ced.lora import Adapter, AdapterBank
from ced.model.dspark import DSpark, DSparkSpec
from ced.model.network import CEDNetwork, init_weights

FORMAT_VERSION = 1  # bump when the generated data changes for the same model, data and settings
BASE = "BASE"
PLAIN = "plain"  # plain chat prompts (an utterance as the whole message), beside the four adapter domains
MANIFEST = "manifest.json"
STATE_FILE = "drafter_state.pt"
CONFIDENCE_THRESHOLD = 0.5
HELDOUT_RECORDED = 2  # held-out prompts per source kept in the manifest record (what the tests re-run)


# ------------------------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class DataSettings:
    """What the generated data depends on besides the model (its cache key)."""

    train_per_source: int = 96
    eval_per_source: int = 6
    max_new: int = 64
    group: int = 16  # prompts of one length decoded together (times the number of adapters: the batch rows)
    seed: int = 0


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000
    batch: int = 64  # anchors per step
    groups: int = 2  # anchors of one window length form a forward; a step averages this many
    lr: float = 1.5e-3
    warmup: int = 50
    weight_decay: float = 0.01
    confidence_weight: float = 1.0
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 100


@dataclass
class Conversation:
    """One generated conversation: prompt + greedy reply under `adapter`, and the target layers' inputs per position."""

    tokens: torch.Tensor  # (L,) int64
    prompt_len: int
    adapter: str
    source: str
    hidden: torch.Tensor  # (L, n_targets * dim)

    def anchors(self, block: int) -> range:
        """t such that token t+1 is a reply token and tokens t+2..t+1+block exist."""
        return range(self.prompt_len - 1, len(self.tokens) - block - 1)


@dataclass
class DrafterData:
    train: list[Conversation]
    heldout: list[Conversation]
    record: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ prompts
def _domain_requests(data_dir: Path, settings: DataSettings) -> dict[str, list[tuple[str, str]]]:
    """split -> [(domain, request)], from the routing request generator (train / test documents and banks)."""
    from build_engines.routing.data import ADAPTER_DESCRIPTIONS, ADAPTER_KINDS
    from build_engines.routing.requests import build_request_items

    items = build_request_items(data_dir, ADAPTER_DESCRIPTIONS, ADAPTER_KINDS, settings.seed,
                                settings.train_per_source, settings.eval_per_source)
    out: dict[str, list[tuple[str, str]]] = {"train": [], "test": []}
    for item in items:
        out[item["split"]].append((ADAPTER_KINDS[item["label"]], item["query"]))
    return out


def _plain_chat(data_dir: Path, split: str, n: int, seed: int, exclude: set[str]) -> list[tuple[str, str]]:
    """n dialogue utterances of `split` as whole user messages, seeded, none equal to an `exclude`d one."""
    from build_engines.routing.requests import domain_facts

    utterances = sorted({f["utterance"] for _, facts in domain_facts(data_dir, "chat", split) for f in facts})
    utterances = [u for u in utterances if u.lower() not in exclude]
    random.Random(f"{seed}:drafter:plain:{split}").shuffle(utterances)
    return [(PLAIN, u) for u in utterances[:n]]


def build_prompts(data_dir: Path, settings: DataSettings) -> dict[str, list[tuple[str, str]]]:
    """{"train": [(source, text)], "heldout": [...]}: four domains plus plain chat, `*_per_source` each."""
    requests = _domain_requests(data_dir, settings)
    heldout = requests["test"] + _plain_chat(data_dir, "test", settings.eval_per_source, settings.seed, set())
    seen = {text.lower() for _, text in heldout}
    train = requests["train"] + _plain_chat(data_dir, "train", settings.train_per_source, settings.seed, seen)
    train = [(s, t) for s, t in train if t.lower() not in seen]
    return {"train": train, "heldout": heldout}


def render(tok: Any, text: str) -> list[int]:
    """A one-message conversation as the serving path renders it (`ChatTokenizer.chat`, generation prompt on)."""
    return tok.chat([{"role": "user", "content": text}])


# ------------------------------------------------------------------------------------------------ generation
def length_groups(prompts: Sequence[list[int]], size: int) -> list[list[int]]:
    """Indices of prompts grouped by exact length, at most `size` a group: rows decoded together must share their
    positions (the network has no padding mask), and equal lengths give that without changing any prompt."""
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_length[len(p)].append(i)
    return [idx[j:j + size] for length in sorted(by_length) for idx in [by_length[length]]
            for j in range(0, len(idx), size)]


@torch.no_grad()
def greedy_rows(net: CEDNetwork, tokens: torch.Tensor, rows: Sequence[Adapter | None], max_new: int,
                stop: int) -> torch.Tensor:
    """(B, P) prompts, one adapter per row -> (B, n) greedy tokens (n <= max_new; every row decodes until all have
    produced `stop`, the surplus after a row's stop is cut by `cut_reply`)."""
    with AdapterBank.rows(list(rows)):
        out = net(tokens)
        state, token = out.state, out.logits[:, -1].argmax(-1)
        produced, done = [token], token == stop
        while len(produced) < max_new and not bool(done.all()):
            out = net(token[:, None], state)
            state, token = out.state, out.logits[:, -1].argmax(-1)
            produced.append(token)
            done |= token == stop
    return torch.stack(produced, 1)


def cut_reply(reply: list[int], stop: int) -> list[int]:
    """The reply up to and including the end-of-turn token (the drafter learns to predict it too)."""
    return reply[:reply.index(stop) + 1] if stop in reply else reply


@torch.no_grad()
def target_hidden(net: CEDNetwork, tokens: torch.Tensor, rows: Sequence[Adapter | None],
                  layers: Sequence[int]) -> torch.Tensor:
    """One teacher-forced pass: (B, S) -> (B, S, n_targets * dim) target-layer inputs under each row's adapter."""
    with AdapterBank.rows(list(rows)):
        hidden = net(tokens, targets=layers).target_hidden
    assert hidden is not None
    return hidden


def generate_sequences(net: CEDNetwork, adapters: dict[str, Adapter | None], prompts: Sequence[tuple[str, list[int]]],
                       spec: DSparkSpec, max_new: int, stop: int, group: int, hidden_dtype: torch.dtype,
                       desc: str = "replies") -> list[Conversation]:
    """Every prompt under every adapter: greedy reply, then its teacher-forced target-layer inputs."""
    names = list(adapters)
    out: list[Conversation] = []
    groups = length_groups([p for _, p in prompts], group)
    for idx in tqdm(groups, desc=desc, unit="batch", mininterval=5):
        pairs = [(i, name) for i in idx for name in names]
        rows = [adapters[name] for _, name in pairs]
        tokens = torch.tensor([prompts[i][1] for i, _ in pairs], dtype=torch.long, device=net.device)
        replies = greedy_rows(net, tokens, rows, max_new, stop)
        full = torch.cat((tokens, replies), 1)
        lengths = [tokens.shape[1] + len(cut_reply(r, stop)) for r in replies.tolist()]
        hidden = target_hidden(net, full[:, :max(lengths)], rows, spec.target_layers)
        for row, ((i, name), length) in enumerate(zip(pairs, lengths)):
            out.append(Conversation(full[row, :length].cpu(), tokens.shape[1], name, prompts[i][0],
                                 hidden[row, :length].to("cpu", hidden_dtype).clone()))
    return out


# ------------------------------------------------------------------------------------------------ cache
def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def model_digest(model_dir: Path) -> str:
    """What the target computes: weights, config, tokenizer, chat format and adapters (not the manifest, which this
    stage rewrites, nor an existing drafter)."""
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and p.name != MANIFEST
                   and p.relative_to(model_dir).parts[0] not in (DRAFTER_DIR, "heldout", "router"))
    h = hashlib.sha256()
    for p in files:
        h.update(p.relative_to(model_dir).as_posix().encode() + b"\0" + _file_digest(p).encode())
    return h.hexdigest()


def data_key(model_dir: Path, data_dir: Path, settings: DataSettings) -> str:
    parts = {"format": FORMAT_VERSION, "model": model_digest(model_dir), "settings": asdict(settings),
             "data": _file_digest(data_dir / "manifest.json")}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _as_rows(seqs: list[Conversation]) -> list[dict[str, Any]]:
    return [asdict(s) for s in seqs]


def _from_rows(rows: list[dict[str, Any]]) -> list[Conversation]:
    return [Conversation(**r) for r in rows]


def prepare_data(model_dir: Path, data_dir: Path, work: Path, settings: DataSettings,
                 net: CEDNetwork, adapters: dict[str, Adapter | None], spec: DSparkSpec, tok: Any) -> DrafterData:
    """Generate (or read back) the training and held-out sequences. Training rows are kept in bf16 (the serving
    engines' width, and half the disk), held-out rows in the network's own dtype (what evaluation must read)."""
    key = data_key(model_dir, data_dir, settings)
    path = work / f"data-{key}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=False)
        return DrafterData(_from_rows(saved["train"]), _from_rows(saved["heldout"]), saved["record"] | {"cached": True})
    started = time.perf_counter()
    prompts = build_prompts(data_dir, settings)
    rendered = {split: [(source, render(tok, text)) for source, text in rows] for split, rows in prompts.items()}
    timings = {"prompts_s": time.perf_counter() - started}
    t = time.perf_counter()
    train = generate_sequences(net, adapters, rendered["train"], spec, settings.max_new, tok.end_of_turn_id,
                               settings.group, torch.bfloat16, "training replies")
    timings["train_generation_s"] = time.perf_counter() - t
    t = time.perf_counter()
    heldout = generate_sequences(net, adapters, rendered["heldout"], spec, settings.max_new, tok.end_of_turn_id,
                                 settings.group, net.embed.weight.dtype, "held-out replies")
    timings["heldout_generation_s"] = time.perf_counter() - t
    record = {"key": key, "cached": False, "settings": asdict(settings), "timings_s": timings,
              "prompts": {k: len(v) for k, v in prompts.items()},
              "heldout_prompts": _recorded_prompts(prompts["heldout"]),
              "train": sequence_stats(train, spec.block_size, tok.end_of_turn_id),
              "heldout": sequence_stats(heldout, spec.block_size, tok.end_of_turn_id)}
    work.mkdir(parents=True, exist_ok=True)
    save_atomic({"train": _as_rows(train), "heldout": _as_rows(heldout), "record": record}, path)
    return DrafterData(train, heldout, record)


def _recorded_prompts(heldout: list[tuple[str, str]]) -> list[dict[str, str]]:
    """A few held-out prompts per source, in the manifest: what tests re-generate to check the shipped drafter."""
    kept: dict[str, list[str]] = defaultdict(list)
    for source, text in heldout:
        if len(kept[source]) < HELDOUT_RECORDED:
            kept[source].append(text)
    return [{"source": s, "text": t} for s, texts in kept.items() for t in texts]


def sequence_stats(seqs: list[Conversation], block: int, stop: int) -> dict[str, Any]:
    replies = [len(s.tokens) - s.prompt_len for s in seqs]
    return {"sequences": len(seqs), "anchors": sum(len(s.anchors(block)) for s in seqs),
            "mean_prompt_tokens": sum(s.prompt_len for s in seqs) / max(1, len(seqs)),
            "mean_reply_tokens": sum(replies) / max(1, len(seqs)),
            "replies_ending_at_end_of_turn": sum(int(s.tokens[-1]) == stop for s in seqs) / max(1, len(seqs))}


# ------------------------------------------------------------------------------------------------ anchors
@dataclass
class Anchors:
    """Every (sequence, t) anchor, grouped by how many window rows it reads (rows of one forward must agree)."""

    seq: torch.Tensor  # (N,)
    t: torch.Tensor  # (N,)
    keep: torch.Tensor  # (N,)
    by_keep: dict[int, torch.Tensor]

    @classmethod
    def of(cls, seqs: Sequence[Conversation], block: int, window: int) -> "Anchors":
        pairs = [(i, t) for i, s in enumerate(seqs) for t in s.anchors(block)]
        if not pairs:
            raise ValueError("no anchor: every reply is shorter than a draft block")
        seq = torch.tensor([p[0] for p in pairs])
        t = torch.tensor([p[1] for p in pairs])
        keep = torch.clamp(t + 1, max=window)
        by_keep = {int(k): torch.nonzero(keep == k).squeeze(1) for k in torch.unique(keep)}
        return cls(seq, t, keep, by_keep)

    def sample_group(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """n anchor indices of one window length: the length of a uniformly drawn anchor, then n anchors of that
        length with replacement, so every anchor is equally likely over a step."""
        first = int(torch.randint(len(self.t), (1,), generator=generator))
        members = self.by_keep[int(self.keep[first])]
        return members[torch.randint(len(members), (n,), generator=generator)]


def gather(seqs: Sequence[Conversation], anchors: Anchors, idx: torch.Tensor, block: int,
           dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Anchors of one window length -> (hidden (n, keep, width), last_token (n,), labels (n, block), start).

    Positions enter the drafter only through RoPE, i.e. relative to each other, so full windows at different t share
    one forward with the start of the first; shorter windows all have t = keep - 1 and so the same positions."""
    keep = int(anchors.keep[idx[0]])
    rows, last, labels = [], [], []
    for i in idx.tolist():
        s, t = seqs[int(anchors.seq[i])], int(anchors.t[i])
        rows.append(s.hidden[t - keep + 1:t + 1])
        last.append(s.tokens[t + 1])
        labels.append(s.tokens[t + 2:t + 2 + block])
    t0 = int(anchors.t[idx[0]])
    return torch.stack(rows).to(dtype), torch.stack(last), torch.stack(labels), t0 - keep + 1


# ------------------------------------------------------------------------------------------------ training
def new_drafter(net: CEDNetwork, seed: int, spec: DSparkSpec | None = None) -> DSpark:
    """The seeded initial drafter (`init_weights`): also the untrained baseline of the evaluation."""
    torch.manual_seed(seed)
    drafter = DSpark(net.cfg, spec or DSparkSpec.scaled(net.cfg))
    init_weights(drafter)
    return drafter.to(net.device)


def drafter_loss(drafter: DSpark, net: CEDNetwork, hidden: torch.Tensor, last: torch.Tensor, labels: torch.Tensor,
                 start: int, confidence_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    """CE of each draft position (true previous token forced) + BCE of the confidence logit against whether that
    position's argmax equals its label (the target computed without grad: the score judges, it does not steer)."""
    out = drafter(hidden, last, net.embed, net.head, start=start, forced=labels)
    ce = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
    with torch.no_grad():
        hit = (out.logits.argmax(-1) == labels).float()
    bce = F.binary_cross_entropy_with_logits(out.confidence, hit)
    parts = {"ce": float(ce.detach()), "bce": float(bce.detach()), "top1": float(hit.mean())}
    return ce + confidence_weight * bce, parts


def _optimizer(drafter: DSpark, cfg: TrainConfig) -> torch.optim.AdamW:
    params = [p for p in drafter.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


def train_step(drafter: DSpark, net: CEDNetwork, seqs: Sequence[Conversation], anchors: Anchors, cfg: TrainConfig,
               generator: torch.Generator) -> dict[str, float]:
    """One update over `cfg.groups` forwards of `cfg.batch / groups` anchors each (gradients averaged)."""
    block = drafter.spec.block_size
    per_group = max(1, cfg.batch // cfg.groups)
    stats: dict[str, float] = defaultdict(float)
    for _ in range(cfg.groups):
        idx = anchors.sample_group(per_group, generator)
        hidden, last, labels, start = gather(seqs, anchors, idx, block)
        device = net.device
        loss, parts = drafter_loss(drafter, net, hidden.to(device), last.to(device), labels.to(device), start,
                                   cfg.confidence_weight)
        (loss / cfg.groups).backward()
        stats["loss"] += float(loss.detach()) / cfg.groups
        for k, v in parts.items():
            stats[k] += v / cfg.groups
    return dict(stats)


def train_drafter(drafter: DSpark, net: CEDNetwork, seqs: Sequence[Conversation], cfg: TrainConfig, work: Path,
                  desc: str = "drafter") -> list[dict[str, float]]:
    """The resumable loop: AdamW, warm-up + cosine, clipping; `work/drafter_state.pt` (weights, optimizer, sampler
    generator, step, history) every `checkpoint_every` steps. A re-run continues from the saved step and ends with
    the weights an uninterrupted run ends with (same anchors, same updates)."""
    anchors = Anchors.of(seqs, drafter.spec.block_size, net.cfg.window_size)
    for p in net.parameters():
        p.requires_grad_(False)
    opt = _optimizer(drafter, cfg)
    generator = torch.Generator().manual_seed(cfg.seed)
    start, history = 0, []
    state_path = work / STATE_FILE
    if state_path.exists():
        saved = torch.load(state_path, map_location=net.device, weights_only=False)
        if saved["settings"] != asdict(cfg):
            raise ValueError(f"{state_path} was written with other settings {saved['settings']}; "
                             "remove it to start over")
        drafter.load_state_dict(saved["drafter"])
        opt.load_state_dict(saved["optimizer"])
        generator.set_state(saved["generator"])
        start, history = saved["step"], saved["history"]

    def save(step: int) -> None:
        work.mkdir(parents=True, exist_ok=True)
        save_atomic({"settings": asdict(cfg), "drafter": drafter.state_dict(), "optimizer": opt.state_dict(),
                      "generator": generator.get_state(), "step": step, "history": history}, state_path)

    drafter.train()
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=desc, mininterval=5)
    t0 = time.perf_counter()
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        stats = train_step(drafter, net, seqs, anchors, cfg, generator)
        if not math.isfinite(stats["loss"]):
            raise FloatingPointError(f"{desc}: loss became {stats['loss']} at step {step}")
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        opt.step()
        history.append({"step": step, **stats, "seconds": time.perf_counter() - t0})
        bar.set_postfix(loss=f"{stats['loss']:.3f}", top1=f"{stats['top1']:.2f}")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            save(step + 1)
    drafter.eval()
    return history


# ------------------------------------------------------------------------------------------------ evaluation
def leading(matches: torch.Tensor) -> torch.Tensor:
    """(n, K) bool -> (n,) how many leading entries are true (what a verifier accepts)."""
    return matches.long().cumprod(-1).sum(-1)


@torch.no_grad()
def drafter_acceptance(drafter: DSpark, net: CEDNetwork, seqs: Sequence[Conversation], batch: int = 64,
                       threshold: float = CONFIDENCE_THRESHOLD) -> dict[str, dict[str, float]]:
    """Per adapter: mean accepted greedy drafts per block, the same with the block cut at the first draft whose
    sigmoid(confidence) < threshold, and the mean drafts the cut leaves (what verification then costs)."""
    block = drafter.spec.block_size
    anchors = Anchors.of(seqs, block, net.cfg.window_size)
    cut_logit = math.log(threshold / (1 - threshold))
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    drafter.eval()
    for members in anchors.by_keep.values():
        for chunk in members.split(batch):
            hidden, last, labels, start = gather(seqs, anchors, chunk, block, net.embed.weight.dtype)
            out = drafter(hidden.to(net.device), last.to(net.device), net.embed, net.head, start=start)
            accepted = leading(out.tokens.cpu() == labels)
            kept = leading(out.confidence.cpu() >= cut_logit)
            for i, a, k in zip(chunk.tolist(), accepted.tolist(), kept.tolist()):
                row = sums[seqs[int(anchors.seq[i])].adapter]
                row["n"] += 1
                row["accepted"] += a
                row["accepted_with_cut"] += min(a, k)
                row["drafts_with_cut"] += k
    return _means(sums)


def ngram_acceptance(seqs: Sequence[Conversation], block: int) -> dict[str, dict[str, float]]:
    """The server's prompt-lookup drafter over the reply so far (as the scheduler calls it), on the same anchors."""
    from ced.drafting.ngram import NgramDrafter

    drafter = NgramDrafter(block=block)
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for s in seqs:
        tokens = s.tokens.tolist()
        for t in s.anchors(block):
            guess = drafter.draft(tokens[s.prompt_len:t + 2], block)
            labels = tokens[t + 2:t + 2 + block]
            row = sums[s.adapter]
            row["n"] += 1
            row["accepted"] += int(leading(torch.tensor([g == y for g, y in zip(guess, labels)] or [False])))
            row["drafts"] += len(guess)
    return _means(sums)


def _means(sums: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    out = {}
    for adapter, row in sums.items():
        n = row.pop("n")
        out[adapter] = {"anchors": int(n), **{k: v / n for k, v in row.items()}}
    return out


def evaluation_table(trained: DSpark, untrained: DSpark, net: CEDNetwork,
                     seqs: Sequence[Conversation]) -> dict[str, dict[str, float]]:
    """adapter (and "all") -> trained, trained_with_cut, drafts_with_cut, ngram, untrained acceptance per block."""
    block = trained.spec.block_size
    ours, base, ngram = drafter_acceptance(trained, net, seqs), drafter_acceptance(untrained, net, seqs), \
        ngram_acceptance(seqs, block)
    table = {}
    for adapter in ours:
        table[adapter] = {"anchors": ours[adapter]["anchors"], "trained": ours[adapter]["accepted"],
                          "trained_with_cut": ours[adapter]["accepted_with_cut"],
                          "drafts_with_cut": ours[adapter]["drafts_with_cut"],
                          "ngram": ngram[adapter]["accepted"], "ngram_drafts": ngram[adapter]["drafts"],
                          "untrained": base[adapter]["accepted"]}
    total = sum(r["anchors"] for r in table.values())
    table["all"] = {"anchors": total, **{k: sum(r[k] * r["anchors"] for r in table.values()) / total
                                         for k in next(iter(table.values())) if k != "anchors"}}
    return table


# ------------------------------------------------------------------------------------------------ the stage
def load_target(model_dir: Path) -> tuple[CEDNetwork, dict[str, Adapter | None], Any]:
    """The reference network (fp32), base + bundled adapters in a fixed order, and the model's tokenizer."""
    from ced.formats.checkpoint import load_checkpoint
    from ced.text.tokenizer import ChatTokenizer

    net = load_checkpoint(model_dir).eval()
    bank = AdapterBank(net.cfg, net)
    bank.attach(net)
    bundled = bank.load_bundled(model_dir)
    adapters: dict[str, Adapter | None] = {BASE: None} | {name: bundled[name] for name in sorted(bundled)}
    return net, adapters, ChatTokenizer.load(model_dir)


def finished(model_dir: Path) -> bool:
    manifest = model_dir / MANIFEST
    return (model_dir / DRAFTER_DIR / WEIGHTS_FILE).exists() and manifest.exists() and \
        "drafter" in json.loads(manifest.read_text())


def update_manifest(model_dir: Path, record: dict[str, Any]) -> dict[str, Any]:
    """Add the drafter's files to `files_sha256`, recount `total_bytes`, set the `drafter` record; every other
    field as it was. A model directory without a manifest gets one with just these keys."""
    path = model_dir / MANIFEST
    manifest = json.loads(path.read_text()) if path.exists() else {}
    files = dict(manifest.get("files_sha256", {}))
    for p in sorted((model_dir / DRAFTER_DIR).rglob("*")):
        if p.is_file():
            files[p.relative_to(model_dir).as_posix()] = _file_digest(p)
    manifest["files_sha256"] = files
    manifest["total_bytes"] = sum((model_dir / f).stat().st_size for f in files)
    manifest["drafter"] = record
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def run_stage(model_dir: Path, data_dir: Path, work: Path, data_settings: DataSettings, train_cfg: TrainConfig,
              command: str = "") -> dict[str, Any]:
    """Data (cached), training (resumable), evaluation, sidecar and manifest record; returns the record."""
    started = time.perf_counter()
    net, adapters, tok = load_target(model_dir)
    spec = DSparkSpec.scaled(net.cfg)
    t = time.perf_counter()
    data = prepare_data(model_dir, data_dir, work, data_settings, net, adapters, spec, tok)
    timings = {"data_s": time.perf_counter() - t}
    run_dir = work / f"run-{_run_key(data, train_cfg)}"
    drafter = new_drafter(net, train_cfg.seed, spec)
    t = time.perf_counter()
    history = train_drafter(drafter, net, data.train, train_cfg, run_dir)
    timings["training_s"] = time.perf_counter() - t
    save_drafter(drafter, model_dir)
    shipped = load_drafter(model_dir)
    assert shipped is not None
    t = time.perf_counter()
    table = evaluation_table(shipped.to(net.device), new_drafter(net, train_cfg.seed, spec), net, data.heldout)
    timings["evaluation_s"] = time.perf_counter() - t
    timings["wall_s"] = time.perf_counter() - started
    record = _record(command, data, train_cfg, history, table, timings, model_dir, shipped)
    update_manifest(model_dir, record)
    return record


def _run_key(data: DrafterData, cfg: TrainConfig) -> str:
    """The training state belongs to one data set (its key covers the model) and one training config."""
    parts = {"data": data.record["key"], "train": asdict(cfg)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _record(command: str, data: DrafterData, cfg: TrainConfig, history: list[dict[str, float]],
            table: dict[str, dict[str, float]], timings: dict[str, float], model_dir: Path,
            drafter: DSpark) -> dict[str, Any]:
    tail = history[-50:]
    final = {k: sum(h[k] for h in tail) / max(1, len(tail)) for k in ("loss", "ce", "bce", "top1")} if tail else {}
    files = [model_dir / DRAFTER_DIR / name for name in ("config.json", WEIGHTS_FILE)]
    return {
        "command": command,
        "spec": drafter.spec.to_release(),
        "parameters": sum(p.numel() for p in drafter.parameters()),
        "bytes": sum(p.stat().st_size for p in files),
        "data": data.record,
        "training": asdict(cfg) | {"final_50_steps_mean": final, "first_step": history[0] if history else None},
        "evaluation": {
            "what": "mean accepted drafts per block of "
                    f"{drafter.spec.block_size} (leading drafts equal to the target's greedy continuation) on "
                    "held-out prompts; trained_with_cut: block stops at the first draft with sigmoid(confidence) "
                    f"< {CONFIDENCE_THRESHOLD} (drafts_with_cut: drafts it keeps); ngram: tritonserver_backend."
                    "drafting.NgramDrafter over the reply so far; untrained: the seeded initial drafter",
            "acceptance": table,
        },
        "timings_s": timings,
        "machine": {"cpu_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                    "platform": platform.platform(), "torch": torch.__version__,
                    "load_average_1_5_15_min_at_end": [round(x, 2) for x in os.getloadavg()]},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("embedded/mol2-small"))
    parser.add_argument("--data", type=Path, default=Path("artifacts/data"), help="prepared corpora (prompts)")
    parser.add_argument("--work", type=Path, default=Path("artifacts/train/drafter"), help="cache and training state")
    defaults_d, defaults_t = DataSettings(), TrainConfig()
    parser.add_argument("--steps", type=int, default=defaults_t.steps)
    parser.add_argument("--batch", type=int, default=defaults_t.batch, help="anchors per step")
    parser.add_argument("--lr", type=float, default=defaults_t.lr)
    parser.add_argument("--train-per-source", type=int, default=defaults_d.train_per_source)
    parser.add_argument("--eval-per-source", type=int, default=defaults_d.eval_per_source)
    parser.add_argument("--max-new", type=int, default=defaults_d.max_new)
    parser.add_argument("--checkpoint-every", type=int, default=defaults_t.checkpoint_every)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--force", action="store_true",
                        help="run although the model has a drafter (training resumes from the state under --work: "
                             "remove it to train from scratch), and write into a committed model directory (the "
                             "default, embedded/mol2-small)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if finished(args.model) and not args.force:
        print(f"{args.model}/{DRAFTER_DIR} and its manifest record exist: skipped (--force trains again)")
        return
    refuse_to_overwrite([args.model / DRAFTER_DIR, args.model / MANIFEST], args.force, "--model DIR (a copy)")
    data_settings = DataSettings(args.train_per_source, args.eval_per_source, args.max_new, seed=args.seed)
    train_cfg = TrainConfig(steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                            checkpoint_every=args.checkpoint_every)
    command = "python -m build_engines.training.drafter_stage " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    record = run_stage(args.model, args.data, args.work, data_settings, train_cfg, command)
    print(json.dumps(record["evaluation"]["acceptance"], indent=1))
    print(f"drafter written to {args.model / DRAFTER_DIR} ({record['bytes'] / 1e6:.2f} MB) in "
          f"{record['timings_s']['wall_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
