"""Reply-weighted loss: which targets of a chat-formatted window count more, read from the tokens alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from build_engines.training.reply_weights import ReplyWeights, weighted_cross_entropy
from ced.text.chat_format import ChatFormat
from ced.text.tokenizer import ChatTokenizer
from tests.conftest import EMBEDDED

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get a weather.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
MESSAGES = [{"role": "user", "content": "Get the weather for Oslo."},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c0", "content": '{"result": "rain"}'},
            {"role": "assistant", "content": "It rains in Oslo."}]


def _weights() -> tuple[ReplyWeights, ChatTokenizer, list[int]]:
    tok = ChatTokenizer.load(EMBEDDED)
    ids = ChatFormat.load(EMBEDDED).encode(MESSAGES, add_generation_prompt=False, tools=TOOLS)
    return ReplyWeights.from_special_ids(tok.special_ids, reply=3.0, first=2.0), tok, ids


def test_targets_inside_each_assistant_turn_weigh_more_and_the_first_most() -> None:
    rw, tok, ids = _weights()
    w = rw.weights(torch.tensor([ids]))[0].tolist()
    opener = tok.special_ids["<|assistant|>"]
    expected = []
    in_reply = False
    for i, token in enumerate(ids):  # target i is ids[i + 1]; weight 1 before the first marker and outside replies
        if token in tok.special_ids.values():
            in_reply = token == opener
        expected.append(6.0 if token == opener else 3.0 if in_reply else 1.0)
    assert w == expected
    assert w.count(6.0) == 2  # two assistant turns: the call and the answer
    # what each reply target predicts: the call (through its end marker), then the answer (through its end marker)
    replies = [ids[i + 1] for i in range(len(ids) - 1) if w[i] > 1.0]
    text = tok.decode(replies)
    assert text.startswith("<tool_call>") and "It rains in Oslo." in text
    assert replies.count(tok.end_of_turn_id) == 2


def test_a_window_cut_mid_reply_weighs_one_until_its_first_marker() -> None:
    rw, tok, ids = _weights()
    start = ids.index(tok.special_ids["<|assistant|>"]) + 3  # inside the call
    w = rw.weights(torch.tensor([ids[start:]]))[0]
    first_marker = next(i for i, t in enumerate(ids[start:]) if t in tok.special_ids.values())
    assert torch.all(w[:first_marker] == 1.0)


def test_documents_weigh_one_and_equal_weights_are_plain_cross_entropy() -> None:
    rw, tok, _ = _weights()
    doc = torch.tensor([[tok.bos_id, *tok.encode("def read_config(path):\n    return path\n"), tok.eos_id]])
    assert torch.all(rw.weights(doc[:, :-1]) == 1.0)
    logits = torch.randn(2, 7, 50)
    targets = torch.randint(0, 50, (2, 7))
    plain = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert torch.allclose(weighted_cross_entropy(logits, targets, torch.full((2, 7), 4.0)), plain)
    w = torch.ones(2, 7)
    w[0, 3] = 10.0
    assert not torch.allclose(weighted_cross_entropy(logits, targets, w), plain)
