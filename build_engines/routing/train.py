"""MoL2 router training: offline H19 extraction, head training with the article's recipes, evaluation.

H19 depends only on the frozen encoder and the query, so it is extracted once (batched, cached on disk) and the
head trains on cached features in minutes; the backbone and the serving adapters are never touched. Each routing
item carries its own candidate set; items of one task share the task's description list and mask the options
they do not offer.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ced.model.network import EncoderEngine
from ced.routing.pointer_head import PointerHead, RouterConfig, option_text, pool_h19
from ced.text.tokenizer import ChatTokenizer, Message

MAX_QUERY_TOKENS = 192
HISTORY_CHARS = 240  # each synthetic history message is cut to this many characters


def query_ids(tok: ChatTokenizer, text: str, history: Sequence[Message] = ()) -> tuple[list[int], list[int]]:
    """(prefix, turn): the ids serving has encoded before the turn (<|bos|> + earlier messages) and the turn itself
    (user message + assistant prompt); H19 is pooled over `turn` only, as the router model does."""
    turn = tok.turn(Message("user", text), generation_prompt=True)
    if len(turn) > MAX_QUERY_TOKENS:  # keep the role marker and the end/assistant markers, trim the middle
        turn = turn[: MAX_QUERY_TOKENS - 3] + turn[-3:]
    prefix = tok.chat(list(history), add_generation_prompt=False) if history else [tok.bos_id]
    return prefix, turn


def synthetic_histories(n: int, pool: Sequence[str], seed: int, max_exchanges: int = 2) -> list[list[Message]]:
    """One seeded conversation prefix per item: 1..`max_exchanges` (user, assistant) exchanges whose texts are drawn
    from `pool` (the routing queries of the same split, any domain; test histories come from test texts only),
    each cut to HISTORY_CHARS.

    Why: in serving, a later turn's H19 is computed with the earlier turns in the encoder's window and global KV,
    so a router trained only on first turns sees a shifted query side mid-conversation. The history's domain is
    drawn independently of the item's answer, so it carries no label and often differs from the current turn
    (the domain switch the router must follow)."""
    rng = random.Random(f"history:{seed}")
    out = []
    for _ in range(n):
        messages = []
        for _ in range(rng.randint(1, max_exchanges)):
            for role in ("user", "assistant"):
                messages.append(Message(role, pool[rng.randrange(len(pool))][:HISTORY_CHARS]))
        out.append(messages)
    return out


def model_digest(model_dir: str | Path) -> str:
    """The key that ties cached H19 features to one set of base weights (first 16 hex digits of their sha256)."""
    return hashlib.sha256((Path(model_dir) / "model.safetensors").read_bytes()).hexdigest()[:16]


@torch.no_grad()
def extract_h19(encoder: EncoderEngine, tok: ChatTokenizer, queries: list[str], cache_dir: Path, model_digest: str,
                batch: int = 32, histories: Sequence[Sequence[Message]] | None = None) -> np.ndarray:
    """(N, dim) pooled H19 per query, batched with right padding (causal: padding never reaches real positions).

    With `histories`, query i is encoded after its conversation prefix, as a later turn is in serving."""
    if histories is not None and len(histories) != len(queries):
        raise ValueError(f"{len(histories)} histories for {len(queries)} queries")
    hist_key = "" if histories is None else "\x01" + json.dumps([[(m.role, m.content) for m in h] for h in histories])
    key = hashlib.sha256((model_digest + "\x00" + "\x00".join(queries) + hist_key).encode()).hexdigest()[:16]
    path = cache_dir / f"h19_{key}.npy"
    if path.exists():
        return np.load(path)
    seqs = [query_ids(tok, q, histories[i] if histories is not None else ()) for i, q in enumerate(queries)]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]) + len(seqs[i][1]))
    out = np.zeros((len(queries), encoder.cfg.dim), dtype=np.float32)
    for start in tqdm(range(0, len(order), batch),
                      desc="H19 extraction" + (" (with history)" if histories is not None else ""), leave=False):
        idx = order[start : start + batch]
        lengths = [len(seqs[i][0]) + len(seqs[i][1]) for i in idx]
        T = max(lengths)
        ids = torch.full((len(idx), T), tok.pad_id, dtype=torch.long)
        mask = torch.zeros(len(idx), T, dtype=torch.bool)
        for row, i in enumerate(idx):
            prefix, turn = seqs[i]
            ids[row, : lengths[row]] = torch.tensor(prefix + turn)
            mask[row, len(prefix) : lengths[row]] = True
        handover, _ = encoder(ids, encoder.new_state(len(idx)))
        out[idx] = pool_h19(handover.encoder_out, mask).numpy()
    cache_dir.mkdir(parents=True, exist_ok=True)
    np.save(path, out)
    return out


@dataclass
class TaskSet:
    """All items of one task: canonical descriptions, features, per-item candidate masks and answers."""

    task: str
    descriptions: list[str]
    features: torch.Tensor  # (N, dim)
    candidates: torch.Tensor  # (N, n) bool
    answers: torch.Tensor  # (N,) index into descriptions
    option_tokens: list[torch.Tensor]  # per description: token ids of option_text(description)

    def __len__(self) -> int:
        return self.features.shape[0]

    def subset(self, idx: torch.Tensor) -> "TaskSet":
        return TaskSet(self.task, self.descriptions, self.features[idx], self.candidates[idx], self.answers[idx],
                       self.option_tokens)


def build_task_sets(items: list[dict], features: np.ndarray, tok: ChatTokenizer) -> dict[str, TaskSet]:
    by_task: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        by_task.setdefault(item["task"], []).append(i)
    sets = {}
    for task, rows in sorted(by_task.items()):
        descriptions = sorted({d for i in rows for d in items[i]["options"]})
        pos = {d: j for j, d in enumerate(descriptions)}
        cand = torch.zeros(len(rows), len(descriptions), dtype=torch.bool)
        ans = torch.zeros(len(rows), dtype=torch.long)
        for r, i in enumerate(rows):
            for d in items[i]["options"]:
                cand[r, pos[d]] = True
            ans[r] = pos[items[i]["options"][items[i]["answer"]]]
        sets[task] = TaskSet(task, descriptions, torch.from_numpy(features[rows]), cand, ans,
                             [torch.tensor(tok.encode(option_text(d))) for d in descriptions])
    return sets


def _logits(head: PointerHead, embed: torch.Tensor, ts: TaskSet, rows: torch.Tensor) -> torch.Tensor:
    cache = head.encode_options([embed[t] for t in ts.option_tokens])
    return head.score(ts.features[rows], cache, ts.candidates[rows])


def train_head(head: PointerHead, embed: torch.Tensor, stages: list[list[TaskSet]], steps_per_stage: list[int],
               batch: int = 64, lr: float = 2e-3, seed: int = 0, progress: bool = True) -> list[float]:
    """Each stage samples batches across its task sets in proportion to their sizes; returns the loss curve."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01)
    losses: list[float] = []
    head.train()
    total = sum(steps_per_stage)
    bar = tqdm(total=total, desc="router head", disable=not progress, leave=False)
    step = 0
    for sets, steps in zip(stages, steps_per_stage):
        sizes = torch.tensor([len(s) for s in sets], dtype=torch.float)
        for _ in range(steps):
            lr_now = lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / max(1, total))))
            for group in opt.param_groups:
                group["lr"] = lr_now
            counts = torch.multinomial(sizes / sizes.sum(), batch, replacement=True,
                                       generator=g).bincount(minlength=len(sets))
            loss = torch.zeros(())
            for ts, n in zip(sets, counts.tolist()):
                if n == 0:
                    continue
                rows = torch.randint(0, len(ts), (n,), generator=g)
                loss = loss + F.cross_entropy(_logits(head, embed, ts, rows), ts.answers[rows], reduction="sum")
            loss = loss / batch
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            losses.append(float(loss.detach()))
            bar.update(1)
            step += 1
    bar.close()
    head.eval()
    return losses


@torch.no_grad()
def predictions(head: PointerHead, embed: torch.Tensor, ts: TaskSet, batch: int = 512) -> torch.Tensor:
    """(N,) chosen description index per item."""
    head.eval()
    return torch.cat([_logits(head, embed, ts, torch.arange(s, min(s + batch, len(ts)))).argmax(-1)
                      for s in range(0, len(ts), batch)])


def accuracy(head: PointerHead, embed: torch.Tensor, ts: TaskSet, batch: int = 512) -> float:
    return float((predictions(head, embed, ts, batch) == ts.answers).float().mean()) if len(ts) else 0.0


def new_head(model_dim: int, seed: int) -> PointerHead:
    torch.manual_seed(seed)
    return PointerHead(RouterConfig.for_model(model_dim))


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")

