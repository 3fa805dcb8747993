"""Three routers behind one interface: MoL (L0 decode), Contextual MoL (contextual q/k on H19) and MoL2 (pointer).

Every router answers `decide(conv, query_ids, options) -> index` for a `Conversation` whose history, ending with
the new user turn (`query_ids`, rendered by the chat template with the assistant prompt), is already encoded and
absorbed, i.e. the point between the encoder pass and the target-adapter replay. None of them may change `conv`:
the two baselines do their temporary work on `conv.fork()` (state updates are functional, so dropping the fork
rolls everything back), and MoL2 only reads.

- `MoLRouter` (Macaron-V1 style): a routing prompt turn listing the numbered options goes through the chat
  template into a fork, the L0 adapter replays and greedily decodes up to `max_label_tokens`, and the first
  integer in range names the option; when the label has none, the option whose number token scored highest at
  the first decoded position wins. The prompt's encoder rows, global KV, decoder rings and the label tokens all
  land in the fork only.
- `ContextualMoLRouter`: the option descriptions are encoded *after* the query through the encoder (a temporary
  branch of the encoder state on a fork), so causal attention lets each option read the query; H19 (mean over
  the hc streams) pooled over the query span (q) and each option's span (k_i) is scored by a small q/k head (two
  `Linear(dim, w)`), which `fit` trains with cross-entropy.
- `MoL2Router`: the `PointerHead` on the H19 of the user turn, which the normal prefill already produced (read
  from the conversation's last hand-over rows, or passed in), against option descriptions seen only through the
  token embedding; the option side is computed once per option list and cached.

`timed(...)` on every router measures only the decision (a `Decision` with the index, seconds and details).
"""

from __future__ import annotations

import abc
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ced.conversation import Conversation
from ced.lora import Adapter, AdapterBank
from ced.model.network import EncoderEngine
from ced.routing.pointer_head import (
    ROUTE_PROMPT,
    OptionCache,
    PointerHead,
    RouterConfig,
    option_text,
    pool_h19,
)
from ced.text.tokenizer import ChatTokenizer, Message

ROUTER_DIR = "router"
ANSWER_INSTRUCTION = "Answer with the number."
OPTION_CACHE_SIZE = 256  # option lists kept per router (MoL2 option side, prompt layouts)


class RoutingError(ValueError):
    """A routing call that cannot be answered (no options, no encoded user turn, bad H19 shape)."""


@dataclass
class Decision:
    """One routing decision: the chosen option, the seconds the decision took, and router-specific details."""

    index: int
    seconds: float
    info: dict[str, Any] = field(default_factory=dict)


class _LRU(OrderedDict):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def put(self, key: Any, value: Any) -> Any:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)
        return value

    def lookup(self, key: Any) -> Any:
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value


class Router(abc.ABC):
    """The common interface. `decide` must leave `conv` byte-identical (encoder state, decoder mirror, rows, rings)."""

    name: str = "router"

    def decide(self, conv: Conversation, query_ids: Sequence[int], options: Sequence[str],
               h19: torch.Tensor | None = None) -> int:
        return self.decide_info(conv, query_ids, options, h19)[0]

    @abc.abstractmethod
    def decide_info(self, conv: Conversation, query_ids: Sequence[int], options: Sequence[str],
                    h19: torch.Tensor | None = None) -> tuple[int, dict[str, Any]]:
        """(chosen index, details); `h19` is an optional precomputed H19 of the user turn (only MoL2 and
        Contextual MoL read it; by default they take it from `conv`'s last hand-over rows)."""

    def prepare(self, options: Sequence[str]) -> None:
        """Warm whatever the router caches per option list (called before timing; a no-op by default)."""

    def timed(self, conv: Conversation, query_ids: Sequence[int], options: Sequence[str],
              h19: torch.Tensor | None = None) -> Decision:
        """The decision alone, wall-clock timed (nothing before or after it is counted)."""
        start = time.perf_counter()
        index, info = self.decide_info(conv, query_ids, options, h19)
        return Decision(index, time.perf_counter() - start, info)


def _check_options(options: Sequence[str]) -> tuple[str, ...]:
    if len(options) == 0:
        raise RoutingError("a routing decision needs at least one option")
    if not all(isinstance(o, str) for o in options):
        raise RoutingError("options must be strings (descriptions)")
    return tuple(options)


def user_turn_h19(conv: Conversation, n_query: int, h19: torch.Tensor | None = None) -> torch.Tensor:
    """The pooled H19 (dim,) of the user turn: from `h19` when given, else from the conversation's last hand-over.

    `h19` may be already pooled, (dim,) or (1, dim), or the raw streams (1, S, hc, dim) of the turn. Without it,
    the decoder session's last W hand-over rows carry `encoder_out`; the turn is the last `n_query` of them (when
    the turn is longer than the replay window, its last W rows). Reading them costs no extra prefill.
    """
    if h19 is not None:
        if h19.dim() == 1:
            return h19.float()
        if h19.dim() == 2 and h19.shape[0] == 1:
            return h19[0].float()
        if h19.dim() == 4 and h19.shape[0] == 1:
            return pool_h19(h19)[0]
        raise RoutingError(f"h19 must be (dim,), (1, dim) or (1, S, hc, dim), got {tuple(h19.shape)}")
    rows = conv.decoder.recent
    if rows is None or rows.positions.numel() == 0:
        raise RoutingError("the conversation has no encoded user turn to route on")
    if int(rows.positions[-1]) != conv.position - 1:
        raise RoutingError(f"the last hand-over row is at position {int(rows.positions[-1])} but the encoder is at "
                           f"{conv.position}: the user turn is not the last thing absorbed")
    if rows.encoder_out.shape[0] != 1:
        raise RoutingError(f"routing reads one conversation at a time, got batch {rows.encoder_out.shape[0]}")
    n = max(1, min(int(n_query), rows.positions.shape[0]))
    return pool_h19(rows.encoder_out[:, -n:])[0]


# ---------------------------------------------------------------------------------------------------------- MoL


def parse_choice(text: str, n_options: int) -> int | None:
    """The first integer in `text` that names an option (1-based), as a 0-based index; None when there is none."""
    for match in re.finditer(r"\d+", text):
        value = int(match.group())
        if 1 <= value <= n_options:
            return value - 1
    return None


class MoLRouter(Router):
    """L0 decode: a numbered routing prompt in a fork of the conversation, decoded greedily under the L0 adapter."""

    name = "MoL"

    def __init__(self, tokenizer: ChatTokenizer, adapter: Adapter | None, max_label_tokens: int = 24,
                 stop_at_end: bool = True, role: str = "user") -> None:
        """`adapter` is L0 (None decodes with the base); `stop_at_end` stops at <|end|>/<|eos|> before
        `max_label_tokens` (False always decodes the full budget, the label-and-reason case)."""
        if max_label_tokens < 1:
            raise ValueError(f"max_label_tokens must be positive, got {max_label_tokens}")
        self.tokenizer, self.adapter = tokenizer, adapter
        self.max_label_tokens, self.stop_at_end, self.role = max_label_tokens, stop_at_end, role
        self._prompts: _LRU = _LRU(OPTION_CACHE_SIZE)

    def prompt_text(self, options: Sequence[str]) -> str:
        lines = [ROUTE_PROMPT] + [f"{i + 1}) {o}" for i, o in enumerate(options)] + [ANSWER_INSTRUCTION]
        return "\n".join(lines)

    def prompt_ids(self, options: Sequence[str]) -> tuple[list[int], list[int]]:
        """(routing prompt turn ids, first token id of each option's number), cached per option list."""
        key = _check_options(options)
        cached = self._prompts.lookup(key)
        if cached is None:
            ids = self.tokenizer.turn(Message(self.role, self.prompt_text(key)), generation_prompt=True)
            numbers = [self.tokenizer.encode(str(i + 1))[0] for i in range(len(key))]
            cached = self._prompts.put(key, (ids, numbers))
        return cached

    def prepare(self, options: Sequence[str]) -> None:
        self.prompt_ids(options)

    @torch.no_grad()
    def decide_info(self, conv: Conversation, query_ids: Sequence[int], options: Sequence[str],
                    h19: torch.Tensor | None = None) -> tuple[int, dict[str, Any]]:
        ids, numbers = self.prompt_ids(options)
        fork = conv.fork()  # every write below (encoder rows, global KV, rings, label tokens) stays in the fork
        device = fork.encoder.device
        fork.extend(torch.tensor([ids], dtype=torch.long, device=device))
        logits = fork.replay(self.adapter).logits[0, -1]
        first = logits
        stop = {self.tokenizer.end_of_turn_id, self.tokenizer.eos_id} if self.stop_at_end else set()
        generated: list[int] = []
        while len(generated) < self.max_label_tokens:
            token = int(logits.argmax())
            if token in stop:
                break
            generated.append(token)
            if len(generated) >= self.max_label_tokens:
                break
            logits = fork.step(torch.tensor([[token]], dtype=torch.long, device=device)).logits[0, -1]
        del fork
        label = self.tokenizer.decode(generated)
        index = parse_choice(label, len(numbers))
        parsed = index is not None
        if index is None:
            index = int(first[torch.tensor(numbers, device=first.device)].argmax())
        return index, {"label": label, "label_tokens": len(generated), "prompt_tokens": len(ids), "parsed": parsed}


# ----------------------------------------------------------------------------------------------- Contextual MoL


class QKHead(nn.Module):
    """Two Linear(dim, w) layers on parameter-free layer-normed H19 features; score = q.k / sqrt(w)."""

    def __init__(self, dim: int, width: int = 64) -> None:
        super().__init__()
        self.dim, self.width = dim, width
        self.wq = nn.Linear(dim, width)
        self.wk = nn.Linear(dim, width)

    def forward(self, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q (B, dim), keys (n, dim) or (B, n, dim) -> (B, n) logits."""
        q = self.wq(F.layer_norm(q, (self.dim,)))
        k = self.wk(F.layer_norm(keys, (self.dim,)))
        if k.dim() == 2:
            return q @ k.t() / self.width ** 0.5
        return torch.einsum("bw,bnw->bn", q, k) / self.width ** 0.5


@dataclass
class ContextualExample:
    """Features of one routing question: query H19 (dim,), option H19 (n, dim), the answer's index."""

    query: torch.Tensor
    keys: torch.Tensor
    answer: int


class ContextualMoLRouter(Router):
    """Options encoded after the query (a temporary encoder branch on a fork), scored by a q/k head on H19."""

    name = "Contextual MoL"

    def __init__(self, encoder: EncoderEngine, tokenizer: ChatTokenizer, width: int = 64, seed: int = 0) -> None:
        self.encoder, self.tokenizer = encoder, tokenizer
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.head = QKHead(encoder.cfg.dim, width).to(encoder.device).eval()
        torch.random.set_rng_state(generator_state)
        self._layouts: _LRU = _LRU(OPTION_CACHE_SIZE)

    def option_layout(self, options: Sequence[str]) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of the route prompt and the options (each after a "\\n- " separator), and each option's
        description span [start, stop) within them; cached per option list (tokenizing is not routing work)."""
        key = _check_options(options)
        cached = self._layouts.lookup(key)
        if cached is None:
            ids = self.tokenizer.encode("\n" + ROUTE_PROMPT)
            spans = []
            for o in key:
                ids += self.tokenizer.encode("\n- ")
                start = len(ids)
                ids += self.tokenizer.encode(o) or [self.tokenizer.pad_id]
                spans.append((start, len(ids)))
            cached = self._layouts.put(key, (ids, spans))
        return cached

    def prepare(self, options: Sequence[str]) -> None:
        self.option_layout(options)

    def _encode(self, tokens: list[int], state) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """H19 (S, dim) of `tokens` run after `state` (functional: the returned state is dropped)."""
        with AdapterBank.rows([None]):
            handover, _ = self.encoder(torch.tensor([tokens], dtype=torch.long, device=self.encoder.device), state)
        return handover.encoder_out[0].float().mean(1)

    @staticmethod
    def _pool_spans(h: torch.Tensor, spans: Sequence[tuple[int, int]], offset: int = 0) -> torch.Tensor:
        return torch.stack([h[offset + a : offset + b].mean(0) for a, b in spans])

    @torch.no_grad()
    def option_keys(self, conv: Conversation, options: Sequence[str]) -> torch.Tensor:
        """(n, dim) H19 of each option, encoded after everything `conv` holds, on a fork (the branch is dropped)."""
        ids, spans = self.option_layout(options)
        fork = conv.fork()
        h = self._encode(ids, fork.encoder_state)
        del fork
        return self._pool_spans(h, spans)

    @torch.no_grad()
    def decide_info(self, conv: Conversation, query_ids: Sequence[int], options: Sequence[str],
                    h19: torch.Tensor | None = None) -> tuple[int, dict[str, Any]]:
        q = user_turn_h19(conv, len(query_ids), h19)
        keys = self.option_keys(conv, options)
        logits = self.head(q.unsqueeze(0).to(keys.device), keys)[0]
        return int(logits.argmax()), {"option_tokens": len(self.option_layout(options)[0])}

    # ------------------------------------------------------------------ training
    @torch.no_grad()
    def features(self, query_ids: Sequence[int], options: Sequence[str], answer: int = -1) -> ContextualExample:
        """One pass from a fresh state over [bos] + query turn + options: q pooled over the query turn, k_i over
        each option (the same computation as `decide` on a conversation that holds only this turn)."""
        ids, spans = self.option_layout(options)
        query = list(query_ids)
        if not query:
            raise RoutingError("empty query")
        h = self._encode([self.tokenizer.bos_id, *query, *ids], self.encoder.new_state(1))
        q = h[1 : 1 + len(query)].mean(0)
        return ContextualExample(q, self._pool_spans(h, spans, 1 + len(query)), int(answer))

    def featurize(self, examples: Sequence[Any]) -> list[ContextualExample]:
        """Examples as (query_ids, options, answer) tuples or `ContextualExample`s -> features."""
        return [e if isinstance(e, ContextualExample) else self.features(e[0], e[1], e[2]) for e in examples]

    def loss(self, examples: Sequence[ContextualExample]) -> float:
        with torch.no_grad():
            return float(sum(F.cross_entropy(self.head(e.query[None], e.keys),
                                             torch.tensor([e.answer], device=e.keys.device)) for e in examples)
                         / max(1, len(examples)))

    def fit(self, examples: Sequence[Any], epochs: int = 30, lr: float = 3e-3, batch: int = 32,
            weight_decay: float = 0.0, seed: int = 0) -> list[float]:
        """Train the q/k head with cross-entropy over each question's options; returns the mean loss per epoch
        (the encoder is frozen; features are computed once)."""
        data = self.featurize(examples)
        if not data:
            raise RoutingError("fit needs at least one example")
        for e in data:
            if not 0 <= e.answer < e.keys.shape[0]:
                raise RoutingError(f"answer {e.answer} is out of range for {e.keys.shape[0]} options")
        opt = torch.optim.AdamW(self.head.parameters(), lr=lr, weight_decay=weight_decay)
        generator = torch.Generator().manual_seed(seed)
        history = []
        self.head.train()
        for _ in range(epochs):
            order = torch.randperm(len(data), generator=generator).tolist()
            total = 0.0
            for start in range(0, len(order), batch):
                chunk = [data[i] for i in order[start : start + batch]]
                loss = sum(F.cross_entropy(self.head(e.query[None], e.keys),
                                           torch.tensor([e.answer], device=e.keys.device)) for e in chunk) / len(chunk)
                opt.zero_grad()
                loss.backward()  # type: ignore[union-attr]
                opt.step()
                total += float(loss.detach()) * len(chunk)  # type: ignore[union-attr]
            history.append(total / len(data))
        self.head.eval()
        return history


# ------------------------------------------------------------------------------------------------------ MoL2


class MoL2Router(Router):
    """The pointer head on the user turn's H19; options through the token embedding only, cached per option list."""

    name = "MoL2"

    def __init__(self, head: PointerHead, embed_weight: torch.Tensor, tokenizer: ChatTokenizer,
                 trained: bool = True) -> None:
        if embed_weight.dim() != 2 or embed_weight.shape[1] != head.cfg.model_dim:
            raise RoutingError(f"embedding {tuple(embed_weight.shape)} does not match the head's model_dim "
                               f"{head.cfg.model_dim}")
        self.head = head.eval()
        self.embed = embed_weight.detach().float()
        self.tokenizer, self.trained = tokenizer, trained
        self._cache: _LRU = _LRU(OPTION_CACHE_SIZE)

    @classmethod
    def from_model(cls, model_dir: str | Path, embed_weight: torch.Tensor, tokenizer: ChatTokenizer,
                   seed: int = 0) -> "MoL2Router":
        """The trained head at `<model_dir>/router/` when present, else a seeded untrained head (`trained` False)."""
        router_dir = Path(model_dir) / ROUTER_DIR
        if (router_dir / "router_config.json").exists():
            return cls(PointerHead.load(router_dir), embed_weight, tokenizer, trained=True)
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        head = PointerHead(RouterConfig.for_model(embed_weight.shape[1])).eval()
        torch.random.set_rng_state(state)
        return cls(head, embed_weight, tokenizer, trained=False)

    @torch.no_grad()
    def compute_option_side(self, options: Sequence[str]) -> OptionCache:
        """The option side, uncached: each option's route prompt + description through the embedding, then the head."""
        key = _check_options(options)
        embedded = [self.embed[torch.tensor(self.tokenizer.encode(option_text(o)) or [self.tokenizer.pad_id])]
                    for o in key]
        return self.head.encode_options(embedded)

    def option_side(self, options: Sequence[str]) -> OptionCache:
        key = _check_options(options)
        cached = self._cache.lookup(key)
        return cached if cached is not None else self._cache.put(key, self.compute_option_side(key))

    def prepare(self, options: Sequence[str]) -> None:
        self.option_side(options)

    @torch.no_grad()
    def scores(self, h19_pooled: torch.Tensor, options: Sequence[str]) -> torch.Tensor:
        """(dim,) pooled H19 -> (n,) pointer logits."""
        return self.head.score(h19_pooled.float().reshape(1, -1), self.option_side(options))[0]

    def decide_h19(self, h19_pooled: torch.Tensor, options: Sequence[str]) -> int:
        """The decision from a pooled H19 alone (what serving does)."""
        return int(self.scores(h19_pooled, options).argmax())

    def decide_info(self, conv: Conversation, query_ids: Sequence[int], options: Sequence[str],
                    h19: torch.Tensor | None = None) -> tuple[int, dict[str, Any]]:
        q = user_turn_h19(conv, len(query_ids), h19)
        return self.decide_h19(q, options), {}
