"""Text: the model directory's chat format on the way in (preprocess model), detokenization of each streamed token
(decoder).

The turn and the history are rendered by the directory's `ChatFormat` (`build_engines.data.chat_format`): the
history as the prefix a (re)started session is encoded from, the user turn as the ids it adds after that history.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from build_engines.data.chat_format import ChatFormatError
from build_engines.data.tokenizer import ChatTokenizer

from .errors import BadRequest

MAX_TEXT_CHARS = 200_000


class TextService:
    def __init__(self, model_dir: str | Path) -> None:
        self.tokenizer = ChatTokenizer.load(Path(model_dir))
        self.format = self.tokenizer.chat_format  # a directory without a chat format fails here, when the model loads

    def preprocess(self, text: str, new_session: bool, history_json: str | None) -> tuple[np.ndarray, np.ndarray, bool]:
        """-> (TOKEN_IDS: the user turn + assistant prompt, PREFIX_IDS: the conversation before it, START).

        A (re)started session gets the history's rendering as its prefix (<|bos|> alone without history) and the turn
        as rendered after that history; a continuing session's turn is rendered after an earlier exchange."""
        if len(text) > MAX_TEXT_CHARS:
            raise BadRequest(f"text has {len(text)} characters, more than {MAX_TEXT_CHARS}")
        user = {"role": "user", "content": text}
        try:
            history = _parse_history(history_json) if history_json else []
            prefix = self.format.encode(history, add_generation_prompt=False)
            turn = self.format.append(history if (new_session or history) else None, user)
        except ChatFormatError as exc:
            raise BadRequest(str(exc)) from None
        return np.asarray(turn, dtype=np.int64), np.asarray(prefix, dtype=np.int64), bool(new_session)

    def piece(self, token_id: int) -> str:
        return "" if token_id < 0 else self.tokenizer.decode([token_id], skip_special=True)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special=True)


def _parse_history(history_json: str) -> list[dict]:
    """The history's messages as sent; which roles and fields are valid is the chat format's to say (the default's
    template takes system/user/assistant with string content and refuses the rest with the reason)."""
    try:
        data = json.loads(history_json)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"history is not valid JSON: {exc.msg}") from None
    if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
        raise BadRequest('history must be a JSON list of {"role": ..., "content": ...} objects')
    for m in data:
        if not isinstance(m.get("role"), str):
            raise BadRequest(f"bad history message {json.dumps(m)[:120]}: role must be a string")
    return data
