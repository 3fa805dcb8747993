"""Text: the model directory's chat format on the way in (preprocess model), detokenization of each streamed token
(decoder).

The turn and the history are rendered by the directory's `ChatFormat` (`ced.text.chat_format`): the
history as the prefix a (re)started session is encoded from, the user turn as the ids it adds after that history.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ced.text.chat_format import ChatFormatError
from ced.text.tokenizer import ChatTokenizer
from tritonserver_backend.errors import BadRequest

MAX_TEXT_CHARS = 200_000


class TextService:
    def __init__(self, model_dir: str | Path) -> None:
        self.tokenizer = ChatTokenizer.load(Path(model_dir))
        self.format = self.tokenizer.chat_format  # a directory without a chat format fails here, when the model loads

    def preprocess(self, text: str, new_session: bool, history_json: str | None, tools_json: str | None = None,
                   turn_json: str | None = None) -> tuple[np.ndarray, np.ndarray, bool]:
        """-> (TOKEN_IDS: the user turn + assistant prompt, PREFIX_IDS: the conversation before it, START).

        A (re)started session gets the history's rendering as its prefix (<|bos|> alone without history) and the turn
        as rendered after that history; a continuing session's turn is rendered after an earlier exchange."""
        if len(text) > MAX_TEXT_CHARS:
            raise BadRequest(f"text has {len(text)} characters, more than {MAX_TEXT_CHARS}")
        user = {"role": "user", "content": text}
        for name, value in (("tools", tools_json), ("turn_messages", turn_json)):
            if value is not None and len(value) > MAX_TEXT_CHARS:
                raise BadRequest(f"{name} has {len(value)} characters, more than {MAX_TEXT_CHARS}")
        try:
            tools = _parse_tools(tools_json) if tools_json else None
            added = _parse_history(turn_json, "turn_messages") if turn_json else [user]
            if turn_json and (text or not added):
                raise BadRequest("turn_messages replaces text: send text empty and at least one message")
            history = _parse_history(history_json) if history_json else []
            prefix = self.format.encode(history, add_generation_prompt=False, tools=tools)
            turn = self.format.append(history if (new_session or history) else None, added, tools=tools)
        except ChatFormatError as exc:
            raise BadRequest(str(exc)) from None
        return np.asarray(turn, dtype=np.int64), np.asarray(prefix, dtype=np.int64), bool(new_session)

    def render(self, text: str, new_session: bool, history_json: str | None, raw: bool = False,
               fork: bool = False, tools_json: str | None = None,
               turn_json: str | None = None) -> tuple[np.ndarray, np.ndarray, bool]:
        """`preprocess` for every kind of turn: a chat turn, a raw one (`preprocess_raw`), and a fork
        (contract.FORK_FROM, with new_session): a chat fork's turn is rendered as a continuing turn after its source's
        conversation."""
        if fork and not new_session:
            raise BadRequest("fork_from starts a session: send it with new_session=true")
        if raw:
            if tools_json or turn_json:
                raise BadRequest("tools and turn_messages are rendered by the chat format: not with raw")
            return self.preprocess_raw(text, new_session, history_json, fork)
        if fork:
            return self.preprocess(text, False, history_json, tools_json, turn_json)[0], np.zeros(0, np.int64), True
        return self.preprocess(text, new_session, history_json, tools_json, turn_json)

    def preprocess_raw(self, text: str, new_session: bool, history_json: str | None,
                       fork: bool = False) -> tuple[np.ndarray, np.ndarray, bool]:
        """A raw (completions) turn: `text` tokenized as it is, no chat template. A started session's prefix is <|bos|>
        (empty text: the session is <|bos|> alone, so forced ids can carry the whole prompt and each gets its
        log-probability); a fork (`fork`, contract.FORK_FROM) starts from its source's state, so it has no prefix and
        may add nothing."""
        if len(text) > MAX_TEXT_CHARS:
            raise BadRequest(f"text has {len(text)} characters, more than {MAX_TEXT_CHARS}")
        if history_json:
            raise BadRequest("history is for chat sessions; a raw session is rebuilt by sending its text again with "
                             "new_session")
        ids = self.tokenizer.encode(text) if text else []
        if fork:
            return np.asarray(ids, np.int64), np.zeros(0, np.int64), True
        if new_session:
            return (np.asarray(ids, np.int64), np.asarray([self.tokenizer.bos_id], np.int64), True) if ids else \
                (np.asarray([self.tokenizer.bos_id], np.int64), np.zeros(0, np.int64), True)
        if not ids:
            raise BadRequest("a raw turn that continues a session needs non-empty text")
        return np.asarray(ids, np.int64), np.zeros(0, np.int64), False

    def piece(self, token_id: int) -> str:
        return "" if token_id < 0 else self.tokenizer.decode([token_id], skip_special=True)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special=True)


def _parse_history(history_json: str, what: str = "history") -> list[dict]:
    """The history's messages as sent; which roles and fields are valid is the chat format's to say (the default's
    template takes system/user/assistant with string content, assistant tool_calls and tool results, and refuses the
    rest with the reason)."""
    try:
        data = json.loads(history_json)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"{what} is not valid JSON: {exc.msg}") from None
    if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
        raise BadRequest(f'{what} must be a JSON list of {{"role": ..., "content": ...}} objects')
    for m in data:
        if not isinstance(m.get("role"), str):
            raise BadRequest(f"bad {what} message {json.dumps(m)[:120]}: role must be a string")
    return data


def _parse_tools(tools_json: str) -> list[dict] | None:
    """OpenAI tool definitions as sent (the chat format renders them); an empty list is no tools."""
    try:
        data = json.loads(tools_json)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"tools is not valid JSON: {exc.msg}") from None
    if not isinstance(data, list) or not all(isinstance(t, dict) and isinstance(t.get("function", t), dict)
                                             and isinstance(t.get("function", t).get("name"), str) for t in data):
        raise BadRequest('tools must be a JSON list of {"type": "function", "function": {"name": ..., ...}} objects')
    return data or None
