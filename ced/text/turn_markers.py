"""Where a conversation's last user turn starts, and how a reply is resent, read from any chat format's token ids.

A stateless frontend (Dynamo's) sends the whole conversation as token ids, rendered by the model's own chat format.
The serving path encodes a turn as "everything before the last user message" (the history a session holds) plus "the
last user message and the assistant prompt" (the turn H19 is pooled over), and continues a session only when a
resent prompt starts with what it holds: the earlier prompt plus the reply as the format renders an assistant message.
Those three facts (the ids that open a user message, the generation prompt, the ids around a reply) depend on the
format, so they are read off the format itself by rendering probe conversations around a sentinel text, never
assumed: the default's `<|user|>` / `<|assistant|>` / `<|end|>` come out of its template, DeepSeek-V4.1's
`<｜User｜>` / `<｜Assistant｜></think>` / its end-of-sentence token out of its renderer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ced.text.chat_format import ChatFormat, ChatFormatError

SENTINEL = "zq sentinel qz"  # probe text: plain words every tokenizer encodes the same way wherever they stand


@dataclass(frozen=True)
class TurnMarkers:
    """The ids a format writes around a user message and a reply (see the module docstring)."""

    user_open: tuple[int, ...]  # what opens a user message (after an earlier exchange)
    generation_prompt: tuple[int, ...]  # what ends a prompt that asks for a reply
    reply_open: tuple[int, ...]  # what the format writes before a resent reply's text, after the generation prompt
    reply_close: tuple[int, ...]  # and after it

    @classmethod
    def of(cls, fmt: ChatFormat) -> "TurnMarkers":
        probe = fmt.text.encode(SENTINEL)
        user = {"role": "user", "content": SENTINEL}
        earlier = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
        turn = fmt.append(earlier, user, add_generation_prompt=False)
        at = _find(turn, probe, "a user message")
        asked = fmt.append(earlier, user, add_generation_prompt=True)
        if asked[:len(turn)] != turn:
            raise ChatFormatError(f"the {fmt.name} format's generation prompt does not follow the user message it ends")
        prompt = fmt.encode([user], add_generation_prompt=True)
        answered = fmt.encode([user, {"role": "assistant", "content": SENTINEL}], add_generation_prompt=False)
        if answered[:len(prompt)] != prompt:
            raise ChatFormatError(f"the {fmt.name} format renders a prompt differently once a reply follows it, so a "
                                  "session cannot be continued from a resent conversation")
        reply = answered[len(prompt):]
        cut = _find(reply, probe, "an assistant message")
        return cls(tuple(turn[:at]), tuple(asked[len(turn):]), tuple(reply[:cut]), tuple(reply[cut + len(probe):]))

    def split(self, prompt: Sequence[int]) -> tuple[list[int], list[int]]:
        """prompt -> (history: everything before the last user message, turn: that message + the generation prompt)."""
        ids = list(prompt)
        n, g = len(self.user_open), len(self.generation_prompt)
        if not self.ends_with_generation_prompt(ids):
            raise ValueError("the prompt must end with a user message and the assistant prompt (a chat request)")
        starts = [i for i in range(len(ids) - g - n, -1, -1) if tuple(ids[i:i + n]) == self.user_open]
        if not starts:
            raise ValueError("the prompt has no user message before the assistant prompt")
        return ids[:starts[0]], ids[starts[0]:]

    def ends_with_generation_prompt(self, prompt: Sequence[int]) -> bool:
        g = len(self.generation_prompt)
        return len(prompt) > g and tuple(prompt[len(prompt) - g:]) == self.generation_prompt

    def reply(self, text_ids: Sequence[int]) -> list[int]:
        """A finished reply as a client resends it, after the prompt that asked for it: the format's ids around it."""
        return [*self.reply_open, *text_ids, *self.reply_close]


def _find(ids: list[int], probe: list[int], what: str) -> int:
    for i in range(len(ids) - len(probe) + 1):
        if ids[i:i + len(probe)] == probe:
            return i
    raise ChatFormatError(f"the chat format does not keep the text of {what} as its own ids; its turns cannot be found")
