"""An oracle for served conversations that shares no code with the serving path: the reference network
(`ced/model`: `CEDNetwork` split into its encoder and decoder, `Conversation` with bounded replay, adapters
applied by `AdapterBank` hooks) driven directly, turn by turn, teacher-forced on the tokens the server sent.

The serving path under test is everything else: the step modules and their ONNX graphs, `build_engines/export/rows`
(per-session rows, batching, padding, LoRA grids), the services, the scheduler and the Triton models. Both sides
read the same checkpoint, adapter files and tokenizer; what the oracle computes for each served token is the
log-probability the network gives it, which the served one must match to fp32 tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ced.conversation import Conversation
from ced.formats.checkpoint import load_checkpoint
from ced.lora import Adapter, AdapterBank
from ced.text.tokenizer import ChatTokenizer, Message


@dataclass
class OracleTurn:
    logprobs: np.ndarray  # (n,) the network's log-probability of each served token
    argmax: np.ndarray  # (n,) the network's most likely token at each position
    margin: np.ndarray  # (n,) its top-1 minus top-2 log-probability (near 0: a tie the engines may break otherwise)


class ReferenceNetwork:
    """The checkpoint loaded once as the reference network, its bundled adapters hooked onto the decoder."""

    def __init__(self, model_dir: Path) -> None:
        net = load_checkpoint(model_dir)
        self.encoder, self.decoder = (m.eval() for m in net.split())
        bank = AdapterBank(net.cfg, self.decoder)
        bank.attach(self.decoder)
        self.adapters: dict[str, Adapter | None] = {"base": None, **bank.load_bundled(model_dir)}
        self.tokenizer = ChatTokenizer.load(model_dir)

    def conversation(self) -> "ReferenceConversation":
        return ReferenceConversation(self)


class ReferenceConversation:
    """One conversation held by the reference network: `turn` appends a user turn under an adapter and scores the
    served reply token by token, then ends the turn the way the serving contract says (the reply's tokens not fed
    yet, then end-of-turn, go through the encoder only)."""

    def __init__(self, network: ReferenceNetwork) -> None:
        self.net = network
        self.conv = Conversation(network.encoder, network.decoder)
        self.started = False

    @property
    def position(self) -> int:
        return self.conv.position

    @torch.no_grad()
    def turn(self, text: str, adapter: str, reply: list[int], finish: str) -> OracleTurn:
        tok = self.net.tokenizer
        ids = tok.turn(Message("user", text), generation_prompt=True)
        if not self.started:
            ids, self.started = [tok.bos_id, *ids], True
        logits = [self.conv.new_turn(torch.tensor([ids]), self.net.adapters[adapter]).logits[0, -1]]
        fed = reply if finish == "end_of_turn" else reply[:-1]  # the token sampled last is fed only if the turn went on
        for token in fed:
            logits.append(self.conv.step(torch.tensor([[token]])).logits[0, -1])
        trailing = [*reply[len(fed):], tok.end_of_turn_id]
        self.conv.extend(torch.tensor([trailing]))
        lp = torch.log_softmax(torch.stack(logits[:len(reply)]).float(), dim=-1)
        top2 = lp.topk(2, dim=-1).values
        chosen = lp.gather(1, torch.tensor(reply)[:, None])[:, 0]
        return OracleTurn(chosen.numpy(), lp.argmax(-1).numpy(), (top2[:, 0] - top2[:, 1]).numpy())
