"""Byte-level BPE tokenizer with chat special tokens, and the chat template shared by training and serving.

One `ChatTokenizer` is used everywhere a conversation becomes token ids (training the chat adapter, the router's
routing prompts, Triton's `preprocess` model), so a turn is tokenized identically in training and serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SYSTEM, USER, ASSISTANT, END_OF_TURN = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, SYSTEM, USER, ASSISTANT, END_OF_TURN)
ROLE_TOKENS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(ValueError):
    """Bad input to the tokenizer or chat template (unknown role, special token inside user text, ...)."""


@dataclass(frozen=True)
class Message:
    role: str
    content: str


def train_tokenizer(texts: Iterable[str], vocab_size: int, out: str | Path) -> "ChatTokenizer":
    """Train byte-level BPE on `texts` (the training split only) and save it as tokenizer.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return ChatTokenizer(tok)


class ChatTokenizer:
    """Encode/decode plain text and chat conversations; special tokens only come from the template."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise TokenizerError(f"tokenizer lacks special tokens {missing}")
        self.special_ids: dict[str, int] = ids  # type: ignore[assignment]
        self.pad_id, self.bos_id, self.eos_id = ids[PAD], ids[BOS], ids[EOS]
        self.end_of_turn_id = ids[END_OF_TURN]

    @classmethod
    def load(cls, path: str | Path) -> "ChatTokenizer":
        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if not path.exists():
            raise TokenizerError(f"{path} not found")
        return cls(Tokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids. Special-token strings in the text are encoded as ordinary characters, never as
        control tokens, so user input cannot forge a turn boundary."""
        ids: list[int] = []
        parts = [text]
        for special in SPECIAL_TOKENS:  # split on special strings so they are byte-encoded piecewise
            parts = [q for p in parts for q in _split_keep(p, special)]
        for part in parts:
            if not part:
                continue
            if part in SPECIAL_TOKENS:
                ids.extend(self.tok.encode(part[0], add_special_tokens=False).ids)
                ids.extend(self.tok.encode(part[1:], add_special_tokens=False).ids)
            else:
                ids.extend(self.tok.encode(part, add_special_tokens=False).ids)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def document(self, text: str) -> list[int]:
        """A training document: <|bos|> text <|eos|>."""
        return [self.bos_id, *self.encode(text), self.eos_id]

    def chat(self, messages: Sequence[Message | dict], add_generation_prompt: bool = True) -> list[int]:
        """<|bos|> then <|role|> content <|end|> per message, then <|assistant|> when a reply is wanted."""
        ids = [self.bos_id]
        for m in messages:
            ids.extend(self.turn(m))
        if add_generation_prompt:
            ids.append(self.special_ids[ASSISTANT])
        return ids

    def turn(self, message: Message | dict, generation_prompt: bool = False) -> list[int]:
        """One message's ids (what a new turn appends to a running conversation)."""
        role, content = (message.role, message.content) if isinstance(message, Message) else (message.get("role"), message.get("content"))
        if role not in ROLE_TOKENS:
            raise TokenizerError(f"unknown chat role {role!r}; expected one of {sorted(ROLE_TOKENS)}")
        if not isinstance(content, str):
            raise TokenizerError(f"message content must be a string, got {type(content).__name__}")
        ids = [self.special_ids[ROLE_TOKENS[role]], *self.encode(content), self.end_of_turn_id]
        if generation_prompt:
            ids.append(self.special_ids[ASSISTANT])
        return ids


def _split_keep(text: str, sep: str) -> list[str]:
    if sep not in text:
        return [text]
    pieces = text.split(sep)
    out: list[str] = []
    for i, piece in enumerate(pieces):
        if i:
            out.append(sep)
        out.append(piece)
    return out
