"""The frontend's tokenizer files give our chat ids; a session continues only from the prompt it expects."""

from __future__ import annotations

import json

import jinja2
import pytest
from tokenizers import Tokenizer

from ced.text.tokenizer import ChatTokenizer, Message
from dynamo_deploy.conversation import SessionRecord, continuation, reply_ids, split_turn
from dynamo_deploy.tokenizer_files import write_model_folder
from tests.conftest import EMBEDDED

CONVERSATION = [Message("system", "Be brief."), Message("user", "Hi! How was your day?"),
                Message("assistant", "Fine, thanks.\n  ok"),
                Message("user", "def mean(xs):\n    return sum(xs) / len(xs)")]


def _frontend_ids(folder, messages) -> list[int]:  # type: ignore[no-untyped-def]
    """What a HF-style frontend does: render tokenizer_config's chat template, tokenize the text with tokenizer.json."""
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    text = jinja2.Template(cfg["chat_template"]).render(messages=[{"role": m.role, "content": m.content}
                                                                  for m in messages],
                                                        add_generation_prompt=True, bos_token=cfg["bos_token"])
    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def test_template_ids_equal_chat_tokenizer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    folder = write_model_folder(EMBEDDED, tmp_path / "model", "mol2-small", 2048)
    tok = ChatTokenizer.load(EMBEDDED)
    for n in range(1, len(CONVERSATION) + 1):
        assert _frontend_ids(folder, CONVERSATION[:n]) == tok.chat(CONVERSATION[:n])
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["eos_token_id"] == tok.end_of_turn_id and cfg["vocab_size"] == tok.vocab_size


def test_split_and_continuation() -> None:
    tok = ChatTokenizer.load(EMBEDDED)
    first = tok.chat(CONVERSATION[:2])
    history, turn = split_turn(tok, first)
    assert history == tok.chat(CONVERSATION[:1], add_generation_prompt=False)
    assert turn == tok.turn(CONVERSATION[1], generation_prompt=True)
    generated = tok.encode(CONVERSATION[2].content)
    record = SessionRecord("s", expected=first + reply_ids(tok, generated))
    second = tok.chat(CONVERSATION)
    assert continuation(record, second) == tok.turn(CONVERSATION[3], generation_prompt=True)
    edited = tok.chat([*CONVERSATION[:2], Message("assistant", "Something else."), CONVERSATION[3]])
    assert continuation(record, edited) is None  # another history: rebuilt, never continued
    assert continuation(None, second) is None
    with pytest.raises(ValueError):
        split_turn(tok, first[:-1])


def test_a_deepseek_v41_directory_gets_a_template_giving_its_format_s_ids(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The release ships encoding rules, not a template: the frontend gets the same rules as a template, and a
    resent conversation splits where the format's last user turn starts."""
    from ced.text.chat_format import ChatFormat
    from tests.ced.text.test_chat_format import BOS as DS_BOS
    from tests.ced.text.test_chat_format import DEEPSEEK_V41, DS_SPECIALS, EOS, _model_dir

    model = tmp_path / "release"
    _model_dir(model, DS_SPECIALS, {"bos_token": DS_BOS, "eos_token": EOS, "chat_format": DEEPSEEK_V41})
    (model / "config.json").write_text(json.dumps({"dim": 8, "n_layers": 2}))
    folder = write_model_folder(model, tmp_path / "model", "release", 2048)
    fmt, tok = ChatFormat.load(model), ChatTokenizer.load(model)
    messages = [Message(m.role, t)
                for m, t in zip(CONVERSATION, ["Be brief.", "hello world", "the weather", "how are you?"])]
    for n in (2, 4):
        ids = _frontend_ids(folder, messages[:n])
        assert ids == fmt.encode([{"role": m.role, "content": m.content} for m in messages[:n]])
        history, turn = split_turn(tok, ids)
        assert history == fmt.encode([{"role": m.role, "content": m.content} for m in messages[:n - 1]],
                                     add_generation_prompt=False)
