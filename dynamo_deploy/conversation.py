"""Which part of a stateless OpenAI prompt is new for a session, and the key a session is found under.

Dynamo's frontend sends the whole conversation as token ids each turn, rendered by the model's own chat format (the
default's: `<|bos|>` then `<|role|> text <|end|>` per message, then `<|assistant|>`; a release's: DeepSeek-V4.1's
markers). Where a user turn starts and how a reply is resent are read off that format (`TurnMarkers`), so any model
directory we serve splits its prompts the way its format writes them. A session holds what its encoder has absorbed; it
continues only when the prompt starts with the conversation as the client will resend it (`expected`: the earlier
prompts plus each reply as the template tokenizes its text). Anything else, an edited history, another worker's session,
a lost one, is rebuilt from the prompt: never continued from a state that does not match.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Sequence

from ced.text.tokenizer import ChatTokenizer
from ced.text.turn_markers import TurnMarkers


@dataclass
class SessionRecord:
    """One conversation on an encoder worker: where its decoder state lives and what a continuation must start with."""

    session_id: str  # the key the encoder and decoder services use
    expected: list[int] = field(default_factory=list)  # the prompt ids a continuing request starts with
    decoder_instance: int | None = None  # the decoder worker holding the decoder side
    turns: int = 0


@functools.lru_cache(maxsize=8)
def markers(tokenizer: ChatTokenizer) -> TurnMarkers:
    """The tokenizer's chat format's turn markers (probed once per tokenizer)."""
    return TurnMarkers.of(tokenizer.chat_format)


def split_turn(tokenizer: ChatTokenizer, prompt: Sequence[int]) -> tuple[list[int], list[int]]:
    """prompt -> (history: <|bos|> + earlier messages, turn: the last user message + the assistant prompt), the split
    the single-server path uses (its H19 is pooled over the turn only)."""
    return markers(tokenizer).split(prompt)


def is_chat_prompt(tokenizer: ChatTokenizer, prompt: Sequence[int]) -> bool:
    """Whether `prompt` ends with the format's assistant prompt (a chat request, not a partial reply)."""
    return markers(tokenizer).ends_with_generation_prompt(prompt)


def continuation(record: SessionRecord | None, prompt: Sequence[int]) -> list[int] | None:
    """The new ids when `prompt` continues `record` (a user turn after what the session holds), else None."""
    if record is None or not record.expected or len(prompt) <= len(record.expected):
        return None
    if list(prompt[:len(record.expected)]) != record.expected:
        return None
    return list(prompt[len(record.expected):])


def reply_ids(tokenizer: ChatTokenizer, generated: Sequence[int]) -> list[int]:
    """A finished reply as the client resends it: its text through the chat format (the default's: the text, then
    <|end|>)."""
    text = tokenizer.decode(list(generated), skip_special=True)
    return markers(tokenizer).reply(tokenizer.chat_format.text.encode(text))


def fingerprint(prompt: Sequence[int], end_of_turn: int) -> str:
    """A conversation's identity in logs: a hash of its ids up to the first <|end|> (its first message)."""
    ids = list(prompt)
    cut = ids.index(end_of_turn) + 1 if end_of_turn in ids else len(ids)
    return hashlib.sha1(",".join(map(str, ids[:cut])).encode()).hexdigest()[:12]
