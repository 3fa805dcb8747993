"""Turn markers read off a chat format: the default's are its old hard-coded role tokens, DeepSeek-V4.1's and a
ChatML-style template's are theirs, and splitting a resent conversation or rebuilding a resent reply with them gives
exactly what the format renders."""

from __future__ import annotations

import pytest

from ced.text.chat_format import ChatFormat
from ced.text.tokenizer import ChatTokenizer
from ced.text.turn_markers import TurnMarkers
from tests.ced.text.test_chat_format import BOS as DS_BOS
from tests.ced.text.test_chat_format import (
    DEEPSEEK_V41,
    DS_SPECIALS,
    EMBEDDED,
    EOS,
    IM_SPECIALS,
    QWEN_STYLE,
    _model_dir,
)

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"},
                {"role": "assistant", "content": "the weather in Paris is sunny"},
                {"role": "user", "content": "how are you?"}]


def _formats(tmp_path) -> dict[str, ChatFormat]:  # type: ignore[no-untyped-def]
    _model_dir(tmp_path / "ds", DS_SPECIALS, {"bos_token": DS_BOS, "eos_token": EOS, "chat_format": DEEPSEEK_V41})
    _model_dir(tmp_path / "im", IM_SPECIALS,
               {"bos_token": "<s>", "eos_token": "<|im_end|>", "chat_template": QWEN_STYLE})
    return {"default": ChatTokenizer.load(EMBEDDED).chat_format, "deepseek": ChatFormat.load(tmp_path / "ds"),
            "chatml": ChatFormat.load(tmp_path / "im")}


def test_the_default_s_markers_are_its_role_tokens() -> None:
    tok = ChatTokenizer.load(EMBEDDED)
    markers = TurnMarkers.of(tok.chat_format)
    assert markers.user_open == (tok.special_ids["<|user|>"],)
    assert markers.generation_prompt == (tok.special_ids["<|assistant|>"],)
    assert (markers.reply_open, markers.reply_close) == ((), (tok.end_of_turn_id,))


@pytest.mark.parametrize("name", ["default", "deepseek", "chatml"])
def test_a_resent_conversation_splits_where_its_last_user_turn_starts(tmp_path, name: str) -> None:  # type: ignore[no-untyped-def]
    fmt = _formats(tmp_path)[name]
    markers = TurnMarkers.of(fmt)
    prompt = fmt.encode(CONVERSATION)
    history, turn = markers.split(prompt)
    assert history + turn == prompt
    assert history == fmt.encode(CONVERSATION[:-1], add_generation_prompt=False)
    assert turn == fmt.append(CONVERSATION[:-1], CONVERSATION[-1]), "the turn is what the serving path encodes for it"
    assert markers.ends_with_generation_prompt(prompt)
    assert not markers.ends_with_generation_prompt(fmt.encode(CONVERSATION, add_generation_prompt=False))
    with pytest.raises(ValueError, match="must end with a user message and the assistant prompt"):
        markers.split(prompt + fmt.text.encode("partial reply"))


@pytest.mark.parametrize("name", ["default", "deepseek", "chatml"])
def test_a_reply_is_rebuilt_as_the_client_resends_it(tmp_path, name: str) -> None:  # type: ignore[no-untyped-def]
    fmt = _formats(tmp_path)[name]
    markers = TurnMarkers.of(fmt)
    prompt = fmt.encode(CONVERSATION[:2])
    reply = "the weather in Paris is sunny"
    resent = fmt.encode([*CONVERSATION[:2], {"role": "assistant", "content": reply}, CONVERSATION[3]])
    held = prompt + markers.reply(fmt.text.encode(reply))
    assert resent[:len(held)] == held, "a continued conversation starts with what the session holds"
    assert markers.split(resent)[0] == held
