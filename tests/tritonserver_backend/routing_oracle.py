"""The adapter MoL2 should pick for a request, computed without the serving path, as the oracle of the served routing.

Why not the in-process pipeline: `InProcessPipeline` routes with the same `RouterService` and `EncoderService` the
served router and encoder run, so a bug in either (a wrong pooling, a stale option cache, the wrong positions of a
later turn) is on both sides of the comparison and passes. Here nothing of `tritonserver_backend` is used: H19 comes
from the reference network (`ced/model`'s encoder, the whole token sequence at once) on the chat
template's ids, pooled over the user turn as the router model is trained (`ced.routing.pointer_head`); the
shipped pointer head is loaded directly and reads the adapters' descriptions (from their adapter_config.json)
through the token embedding. Both sides read the same checkpoint, head, descriptions and tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ced.formats.checkpoint import load_checkpoint
from ced.model.network import EncoderEngine
from ced.routing.pointer_head import load_router_head, option_text, pool_h19
from ced.text.tokenizer import ChatTokenizer, Message

DESCRIPTION_KEY = "mol2_description"  # the adapter_config.json field the adapters' descriptions are stored in


@dataclass(frozen=True)
class Choice:
    adapter: str
    margin: float  # the pointer's top-1 minus top-2 logit: near 0 is a tie that rounding may break either way


class RoutingOracle:
    def __init__(self, model_dir: Path) -> None:
        net = load_checkpoint(model_dir)
        self.encoder = EncoderEngine.from_state_dict(net.cfg, net.state_dict()).eval()
        self.tokenizer = ChatTokenizer.load(model_dir)
        self.head, trained = load_router_head(model_dir, net.cfg.dim)
        assert trained, f"{model_dir} has no trained router head: the oracle would score with random weights"
        self.bundled = {d.name: json.loads((d / "adapter_config.json").read_text())[DESCRIPTION_KEY]
                        for d in sorted((Path(model_dir) / "adapters").iterdir())}

    @torch.no_grad()
    def h19(self, prefix: Sequence[int], turn: Sequence[int]) -> torch.Tensor:
        """(dim,) H19 of `turn` encoded after `prefix`: mean over the hc streams, then over the turn's positions."""
        ids = torch.tensor([[*prefix, *turn]])
        handover, _ = self.encoder(ids, self.encoder.new_state(1))
        mask = torch.zeros(ids.shape, dtype=torch.bool)
        mask[0, len(prefix):] = True
        return pool_h19(handover.encoder_out, mask)[0]

    @torch.no_grad()
    def choose(self, rows: torch.Tensor, descriptions: Mapping[str, str]) -> list[Choice]:
        """The head's pick among `descriptions` (name -> text) for each (dim,) row of `rows`."""
        names = sorted(descriptions)
        embed = self.encoder.embed.weight.float()
        options = self.head.encode_options([embed[torch.tensor(self.tokenizer.encode(option_text(descriptions[n])))]
                                            for n in names])
        logits = self.head.score(rows.float(), options)
        top = logits.topk(2, dim=-1)
        return [Choice(names[int(i)], float(v[0] - v[1])) for i, v in zip(top.indices[:, 0], top.values)]

    def first_turns(self, texts: Sequence[str], descriptions: Mapping[str, str]) -> list[Choice]:
        """Each text as the first turn of its own session: <|bos|>, then the user turn and the assistant prompt."""
        rows = [self.h19([self.tokenizer.bos_id], self._turn(text)) for text in texts]
        return self.choose(torch.stack(rows), descriptions)

    def conversation(self, texts: Sequence[str], replies: Sequence[Sequence[int]],
                     descriptions: Mapping[str, str]) -> list[Choice]:
        """The texts as the turns of one session, each answered by the reply token ids given (the server's own: the
        question here is only which adapter each turn gets), closed by <|end|> as a session holds a finished turn
        (also one cut by max_tokens)."""
        assert len(texts) == len(replies), (len(texts), len(replies))
        end = self.tokenizer.end_of_turn_id
        held, rows = [self.tokenizer.bos_id], []
        for text, reply in zip(texts, replies):
            turn = self._turn(text)
            rows.append(self.h19(held, turn))
            held = [*held, *turn, *reply, *([] if reply and reply[-1] == end else [end])]
        return self.choose(torch.stack(rows), descriptions)

    def _turn(self, text: str) -> list[int]:
        return self.tokenizer.turn(Message("user", text), generation_prompt=True)
