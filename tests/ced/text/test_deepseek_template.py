"""The DeepSeek-V4.1 chat template (for template-only frontends) renders exactly what our DeepSeek-V4.1 renderer
renders, on random system/user/assistant conversations, and refuses what it does not render."""

from __future__ import annotations

import json
import random

import pytest

from ced.text.chat_format import ChatFormat, ChatFormatError
from ced.text.deepseek_template import DEEPSEEK_V41_CHAT_TEMPLATE
from tests.ced.text.test_chat_format import BOS as DS_BOS
from tests.ced.text.test_chat_format import DEEPSEEK_V41, DS_SPECIALS, EOS, _model_dir


def _pair(tmp_path) -> tuple[ChatFormat, ChatFormat]:  # type: ignore[no-untyped-def]
    _model_dir(tmp_path / "builtin", DS_SPECIALS, {"bos_token": DS_BOS, "eos_token": EOS, "chat_format": DEEPSEEK_V41})
    _model_dir(tmp_path / "template", DS_SPECIALS,
               {"bos_token": DS_BOS, "eos_token": EOS, "chat_template": DEEPSEEK_V41_CHAT_TEMPLATE})
    return ChatFormat.load(tmp_path / "builtin"), ChatFormat.load(tmp_path / "template")


def test_the_template_renders_as_the_renderer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    builtin, template = _pair(tmp_path)
    rng = random.Random(41)
    texts = ["", "hello world", "a\n\nb", " spaced ", "é漢字🙂", "{{ x }}", "{% raw %}", "<｜User｜>",
             "the weather in Paris"]
    for _ in range(300):
        conv = [{"role": rng.choice(("system", "user", "user", "assistant")), "content": rng.choice(texts)}
                for _ in range(rng.randint(1, 7))]
        for prompt in (True, False):
            want = builtin.render(conv, add_generation_prompt=prompt)
            assert template.render(conv, add_generation_prompt=prompt) == want, json.dumps(conv)
            assert (template.encode(conv, add_generation_prompt=prompt)
                    == builtin.encode(conv, add_generation_prompt=prompt))


def test_the_template_refuses_what_it_does_not_render(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, template = _pair(tmp_path)
    user = {"role": "user", "content": "hi"}
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    for conv, kw in (([user], {"thinking": True}), ([user, call], {}), ([user, {"role": "tool", "content": "x"}], {}),
                     ([user], {"tools": [{"type": "function", "function": {"name": "f"}}]})):
        with pytest.raises(ChatFormatError):
            template.render(conv, **kw)
