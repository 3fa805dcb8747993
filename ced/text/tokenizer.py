"""Byte-level BPE tokenizer of the embedded default, and `ChatTokenizer`: plain text and conversations -> token ids.

One `ChatTokenizer` is used everywhere a conversation becomes token ids (training the chat adapter, the router's
routing prompts, Triton's `preprocess` model), so a turn is tokenized identically in training and serving. How a
conversation is rendered is not decided here: `ChatTokenizer.load` reads the model directory's chat format
(`ced.text.chat_format`), which for the default is the Jinja template its tokenizer_config.json ships.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ced.text.chat_format import (
    TOKENIZER_CONFIG,
    ChatFormat,
    ChatFormatError,
    Message,
    NoChatFormat,
    PlainText,
)

__all__ = ["ASSISTANT", "BOS", "END_OF_TURN", "EOS", "PAD", "SPECIAL_TOKENS", "SYSTEM", "TOKENIZER_FILE", "USER",
           "ChatTokenizer", "Message", "TokenizerError", "default_tokenizer_config", "train_tokenizer"]

# The default's vocabulary of control tokens (what `train_tokenizer` reserves). Its chat format lives in its files.
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SYSTEM, USER, ASSISTANT, END_OF_TURN = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, SYSTEM, USER, ASSISTANT, END_OF_TURN)
TOKENIZER_FILE = "tokenizer.json"

# The default's chat format, written into tokenizer_config.json next to every tokenizer `train_tokenizer` makes (and
# shipped in embedded/mol2-small): <|bos|>, then <|role|> content <|end|> per message, then <|assistant|> when a reply
# is wanted. One line without whitespace between tags, so it renders the same with or without HF's trim_blocks.
# Tools (ours: the default had no tool syntax, and its vocabulary has no tool tokens, so the tags are plain text):
# `tools` become a system message right after <|bos|> (TOOL_PROMPT, then each function's JSON on a line of its own);
# an assistant's tool calls follow its text as <tool_call>{"name": NAME, "arguments": ARGS}</tool_call> each (ARGS the
# arguments as sent: a JSON string as is, an object as JSON); a tool result is a user turn of its own,
# <|user|><tool_result>TEXT</tool_result><|end|> (one per result, so a session can take results one turn at a time).
# What is parsed back out of a reply: ced.text.tool_parsers.JsonTagSyntax.
TOOL_PROMPT = ("You can call the tools below. To call one, reply with <tool_call>{\"name\": NAME, \"arguments\": "
               "{...}}</tool_call>; its result comes back as <tool_result>...</tool_result>. Tools:")
MOL2_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '" + SYSTEM + TOOL_PROMPT.replace("\\", "\\\\").replace("'", "\\'") + "' }}"
    "{% for tool in tools %}"
    "{{ '\\n' ~ ((tool['function'] if tool['function'] is defined else tool) | tojson) }}{% endfor %}"
    "{{ '" + END_OF_TURN + "' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception(\"unknown chat role '\" ~ message['role'] ~ \"'; "
    "expected one of ['assistant', 'system', 'tool', 'user']\") }}"
    "{% elif message['content'] is not string and not (message['role'] == 'assistant' and message['tool_calls'] "
    "and message['content'] is none) %}{{ raise_exception('message content must be a string') }}{% endif %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '" + USER + "<tool_result>' ~ message['content'] ~ '</tool_result>" + END_OF_TURN + "' }}"
    "{% else %}{{ '<|' ~ message['role'] ~ '|>' ~ (message['content'] if message['content'] is string else '') }}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>{\"name\": ' ~ (call['function']['name'] | tojson) ~ ', \"arguments\": ' ~ "
    "(call['function']['arguments'] if call['function']['arguments'] is string "
    "else (call['function']['arguments'] | tojson)) ~ '}</tool_call>' }}"
    "{% endfor %}{% endif %}{{ '" + END_OF_TURN + "' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + ASSISTANT + "' }}{% endif %}"
)

TokenizerError = ChatFormatError  # one error type for bad input to the tokenizer or its chat format


def default_tokenizer_config() -> dict:
    """The default's tokenizer_config.json (HF fields; eos_token is the end of a turn, where generation stops)."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": END_OF_TURN, "pad_token": PAD,
            "additional_special_tokens": [EOS, SYSTEM, USER, ASSISTANT], "add_bos_token": False, "add_eos_token": False,
            "clean_up_tokenization_spaces": False, "chat_template": MOL2_CHAT_TEMPLATE}


def train_tokenizer(texts: Iterable[str], vocab_size: int, out: str | Path) -> "ChatTokenizer":
    """Train byte-level BPE on `texts` (the training split only); save it as tokenizer.json and, beside it, the
    default's tokenizer_config.json (its chat format)."""
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
    (out.parent / TOKENIZER_CONFIG).write_text(json.dumps(default_tokenizer_config(), indent=2, ensure_ascii=False)
                                               + "\n")
    return ChatTokenizer.load(out)


class ChatTokenizer:
    """Encode/decode plain text, and conversations through the model directory's chat format.

    Special-token strings in text are always encoded as characters; control tokens only come from the format."""

    def __init__(self, tokenizer: Tokenizer, chat_format: ChatFormat | None = None, no_format: str = "") -> None:
        """`chat_format` None: plain text only (`no_format` says why a conversation is refused)."""
        self.tok = tokenizer
        self.text = PlainText(tokenizer)
        self._format = chat_format
        self._no_format = no_format or "this tokenizer was made without a model directory's chat format"
        self.special_ids: dict[str, int] = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
        if chat_format is not None:
            self.end_of_turn_id = chat_format.end_of_turn_id
            bos = chat_format.bos_id
            pad = chat_format.pad_id
        else:  # a bare tokenizer.json of the default's vocabulary (documents need bos/eos, not a chat format)
            missing = [t for t in (BOS, END_OF_TURN) if t not in self.special_ids]
            if missing:
                raise TokenizerError(f"tokenizer lacks special tokens {missing}, and {self._no_format}")
            self.end_of_turn_id, bos, pad = (self.special_ids[END_OF_TURN], self.special_ids[BOS],
                                             self.special_ids.get(PAD))
        if bos is None:
            raise TokenizerError("the chat format names no bos_token (a conversation's first token)")
        self.bos_id: int = bos
        self.pad_id: int = pad if pad is not None else self.end_of_turn_id
        self.eos_id: int = self.special_ids.get(EOS, self.end_of_turn_id)  # a training document's end

    @classmethod
    def load(cls, path: str | Path) -> "ChatTokenizer":
        """`path`: a model directory or its tokenizer.json. The directory's chat format is loaded with it; a directory
        without one still loads (plain text, documents) and refuses conversations with the reason."""
        path = Path(path)
        folder, file = (path, path / TOKENIZER_FILE) if path.is_dir() else (path.parent, path)
        if not file.exists():
            raise TokenizerError(f"{file} not found")
        tok = Tokenizer.from_file(str(file))
        try:
            return cls(tok, ChatFormat.load(folder, tok))
        except NoChatFormat as exc:  # a broken format (bad template, unknown name) raises at once, never falls back
            return cls(tok, None, str(exc))

    @property
    def chat_format(self) -> ChatFormat:
        """The model directory's chat format (raises ChatFormatError when there is none)."""
        if self._format is None:
            raise ChatFormatError(self._no_format)
        return self._format

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids. Special-token strings in the text are encoded as ordinary characters, never as
        control tokens, so user input cannot forge a turn boundary."""
        return self.text.encode(text)

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def document(self, text: str) -> list[int]:
        """A training document: <|bos|> text <|eos|>."""
        return [self.bos_id, *self.encode(text), self.eos_id]

    def chat(self, messages: Sequence[Message | dict], add_generation_prompt: bool = True) -> list[int]:
        """The whole conversation's ids in the model directory's chat format (ending with the assistant's header when
        a reply is wanted)."""
        return self.chat_format.encode(messages, add_generation_prompt=add_generation_prompt)

    def turn(self, message: Message | dict, generation_prompt: bool = False) -> list[int]:
        """One message's ids (what a new turn appends to a running conversation past its first exchange)."""
        return self.chat_format.append(None, message, add_generation_prompt=generation_prompt)
