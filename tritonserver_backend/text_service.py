"""Text: the chat template on the way in (preprocess model), detokenization of each streamed token (decoder)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from build_engines.data.tokenizer import ChatTokenizer, Message, TokenizerError

from .errors import BadRequest

MAX_TEXT_CHARS = 200_000


class TextService:
    def __init__(self, model_dir: str | Path) -> None:
        self.tokenizer = ChatTokenizer.load(Path(model_dir))

    def preprocess(self, text: str, new_session: bool, history_json: str | None) -> tuple[np.ndarray, np.ndarray, bool]:
        """-> (TOKEN_IDS: the user turn + assistant prompt, PREFIX_IDS: <|bos|> + history turns, START)."""
        if len(text) > MAX_TEXT_CHARS:
            raise BadRequest(f"text has {len(text)} characters, more than {MAX_TEXT_CHARS}")
        try:
            turn = self.tokenizer.turn(Message("user", text), generation_prompt=True)
            prefix = [self.tokenizer.bos_id]
            if history_json:
                for m in _parse_history(history_json):
                    prefix.extend(self.tokenizer.turn(m))
        except TokenizerError as exc:
            raise BadRequest(str(exc)) from None
        return np.asarray(turn, dtype=np.int64), np.asarray(prefix, dtype=np.int64), bool(new_session)

    def piece(self, token_id: int) -> str:
        return "" if token_id < 0 else self.tokenizer.decode([token_id], skip_special=True)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special=True)


def _parse_history(history_json: str) -> list[Message]:
    try:
        data = json.loads(history_json)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"history is not valid JSON: {exc.msg}") from None
    if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
        raise BadRequest('history must be a JSON list of {"role": ..., "content": ...} objects')
    out = []
    for m in data:
        if m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
            raise BadRequest(f"bad history message {json.dumps(m)[:120]}: role must be system/user/assistant and content a string")
        out.append(Message(m["role"], m["content"]))
    return out
