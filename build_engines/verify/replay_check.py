"""Verification of bounded replay against a full recompute: the article's switch experiment on our model.

For each (source, target) pair: the source writes a history token by token (input, then its own greedy reply), a
new user turn is appended, the conversation switches to the target (bounded replay of the last W positions), and
the target force-decodes a continuation. That deployed path is compared with
- the oracle: one full recompute of the whole sequence under the target, and
- the no-switch control: the target throughout, prefix in one pass then token by token (no replay), which
  isolates the incremental-computation error.
The forced continuation is the greedy output of the BASE-history replay path under the target, as in the article.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ced.conversation import Conversation
from ced.lora import Adapter, AdapterBank
from ced.model.network import CEDNetwork

BASE = "BASE"


@dataclass
class Comparison:
    """Metrics of some logits against the oracle's, over a forced continuation."""

    logit_mae: float
    top1_agreement: float
    ppl_ratio: float  # exp(CE_path - CE_oracle)
    per_position_mae: list[float]
    per_position_top1: list[float]

    @staticmethod
    def of(logits: torch.Tensor, oracle: torch.Tensor, targets: torch.Tensor) -> "Comparison":
        """logits, oracle: (n, V) fp32 predicting `targets` (n,)."""
        diff = (logits - oracle).abs().mean(-1)
        agree = (logits.argmax(-1) == oracle.argmax(-1)).float()
        ce_path = F.cross_entropy(logits, targets).item()
        ce_oracle = F.cross_entropy(oracle, targets).item()
        return Comparison(float(diff.mean()), float(agree.mean()), math.exp(ce_path - ce_oracle), diff.tolist(),
                          agree.tolist())


@dataclass
class PairResult:
    source: str
    target: str
    path: Comparison
    logits: torch.Tensor = field(repr=False)  # (n, V) the path's logits, for bitwise comparison across sources
    layer_mae: list[float]  # per decoder layer (20..39): hidden-state MAE of the replayed rows against the oracle


@dataclass
class TargetResult:
    target: str
    control: Comparison
    ce_oracle: float


class ReplayExperiment:
    """Runs the switch experiment on one network and a set of named adapters (None = BASE)."""

    def __init__(self, net: CEDNetwork, adapters: dict[str, Adapter | None], replay_window: int | None = None,
                 adapter_on_encoder: bool = False) -> None:
        self.net, self.cfg = net.eval(), net.cfg
        self.adapters = adapters
        self.encoder, self.decoder = net.split()
        bank = AdapterBank(self.cfg, net)
        self._hooks = (bank.attach(self.net) + bank.attach(self.decoder)
                       + (bank.attach(self.encoder) if adapter_on_encoder else []))
        self.replay_window = replay_window or self.cfg.window_size
        self.adapter_on_encoder = adapter_on_encoder

    def _conversation(self) -> Conversation:
        return Conversation(self.encoder, self.decoder, self.replay_window, adapter_on_encoder=self.adapter_on_encoder)

    @torch.no_grad()
    def write_history(self, source: str, history: torch.Tensor) -> Conversation:
        """The source computes the whole history (input and reply) token by token under its adapter."""
        conv = self._conversation()
        conv.new_turn(history[:, :1], self.adapters[source])
        for i in range(1, history.shape[1]):
            conv.step(history[:, i : i + 1])
        return conv

    @torch.no_grad()
    def greedy_reply(self, prompt: torch.Tensor, n: int) -> torch.Tensor:
        """BASE's greedy reply to the prompt: the reply every source then writes into its history."""
        with AdapterBank.rows([None]):
            out = self.net(prompt)
            state, tokens = out.state, [int(out.logits[0, -1].argmax())]
            for _ in range(n - 1):
                out = self.net(torch.tensor([[tokens[-1]]]), state)
                state = out.state
                tokens.append(int(out.logits[0, -1].argmax()))
        return torch.tensor([tokens], dtype=torch.long)

    @torch.no_grad()
    def switch_and_decode(self, history: Conversation, turn: torch.Tensor, target: str, forced: torch.Tensor | None,
                          n: int, trace: bool = False,
                          ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor] | None]:
        """New turn + switch to `target`, then decode n tokens (forced, or greedy when `forced` is None).

        Returns (logits (n, V) predicting each continuation token, the continuation (n,), replay hidden states).
        """
        conv = history.fork()
        out = conv.new_turn(turn, self.adapters[target], trace=trace)
        hidden = out.hidden
        logits, tokens = [out.logits[0, -1]], []
        for i in range(n):
            tok = int(forced[i]) if forced is not None else int(logits[-1].argmax())
            tokens.append(tok)
            if i + 1 < n:
                logits.append(conv.step(torch.tensor([[tok]])).logits[0, -1])
        return torch.stack(logits), torch.tensor(tokens), hidden

    @torch.no_grad()
    def oracle(self, target: str, sequence: torch.Tensor, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Full recompute under the target; logits predicting the last n tokens, and every layer's streams."""
        with AdapterBank.rows([self.adapters[target]]):
            out = self.net(sequence, trace=True)
        return out.logits[0, -n - 1 : -1], out.hidden or []

    @torch.no_grad()
    def control(self, target: str, sequence: torch.Tensor, n: int) -> torch.Tensor:
        """No switch, no replay: the target prefills the prefix in one pass, then continues token by token."""
        adapter = self.adapters[target]
        prefix_len = sequence.shape[1] - n
        with AdapterBank.rows([adapter]):
            out = self.net(sequence[:, :prefix_len])
            logits, state = [out.logits[0, -1]], out.state
            for i in range(prefix_len, sequence.shape[1] - 1):
                out = self.net(sequence[:, i : i + 1], state)
                state = out.state
                logits.append(out.logits[0, -1])
        return torch.stack(logits)

    def run(self, prompt: torch.Tensor, reply_len: int, turn: torch.Tensor, n_continuation: int,
            sources: list[str] | None = None, targets: list[str] | None = None,
            progress: bool = True) -> tuple[list[PairResult], list[TargetResult]]:
        """All (source, target) pairs; every source writes the same tokens (prompt + BASE's greedy reply)."""
        sources = sources or list(self.adapters)
        targets = targets or list(self.adapters)
        E = self.cfg.first_decoder_layer
        history = torch.cat((prompt, self.greedy_reply(prompt, reply_len)), 1)
        histories = {s: self.write_history(s, history)
                     for s in tqdm(sources, desc="histories (token by token)", disable=not progress)}
        base_history = histories[BASE] if BASE in histories else self.write_history(BASE, history)
        rows = slice(history.shape[1] + turn.shape[1] - self.replay_window, history.shape[1] + turn.shape[1])
        pairs: list[PairResult] = []
        per_target: list[TargetResult] = []
        for t in tqdm(targets, desc="targets", disable=not progress):
            _, forced, _ = self.switch_and_decode(base_history, turn, t, None, n_continuation)
            sequence = torch.cat((history, turn, forced.unsqueeze(0)), 1)
            oracle_logits, oracle_hidden = self.oracle(t, sequence, n_continuation)
            control = Comparison.of(self.control(t, sequence, n_continuation), oracle_logits, forced)
            per_target.append(TargetResult(t, control, F.cross_entropy(oracle_logits, forced).item()))
            for s in sources:
                logits, _, replay_hidden = self.switch_and_decode(histories[s], turn, t, forced, n_continuation,
                                                                  trace=True)
                layer_mae = [float((h - oracle_hidden[E + i][:, rows]).abs().mean())
                             for i, h in enumerate(replay_hidden or [])]
                pairs.append(PairResult(s, t, Comparison.of(logits, oracle_logits, forced), logits, layer_mae))
        return pairs, per_target

    @torch.no_grad()
    def length_sweep_point(self, target: str, tokens: torch.Tensor, suffix_len: int) -> list[float]:
        """Per-decoder-layer hidden MAE of a replay segment against the oracle, for one context length.

        The prefix (all but `suffix_len` tokens) and the suffix are encoded in two chunks; the decoder replays from
        W positions before the end of the prefix through the suffix with empty rings; the oracle computes the
        whole sequence in one pass. With a prefix of at most W tokens the replay covers everything.
        """
        T = tokens.shape[1]
        prefix = T - suffix_len
        conv = Conversation(self.encoder, self.decoder, replay_window=suffix_len + self.replay_window)
        conv.extend(tokens[:, :prefix])
        conv.extend(tokens[:, prefix:])
        out = conv.replay(self.adapters[target], trace=True)
        _, oracle_hidden = self.oracle(target, tokens, 1)
        start = max(0, prefix - self.replay_window)
        E = self.cfg.first_decoder_layer
        return [float((h - oracle_hidden[E + i][:, start:]).abs().mean()) for i, h in enumerate(out.hidden or [])]
