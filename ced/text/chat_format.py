"""A model directory's chat format: how a conversation becomes text, and how that text becomes token ids.

Why this exists: a released model fixes its own prompt format (role markers, special tokens, thinking on/off, tool
results) in the files it ships, and a model fed another format answers worse or not at all. So the format is read from
the model directory, never hard-coded for one model; the embedded default ships its own template the same way.

How the directory selects its format (first match wins; `ChatFormat.load`):

1. a Jinja ``chat_template`` in ``tokenizer_config.json`` (or a ``chat_template.jinja`` file), the Hugging Face
   convention: rendered in a sandboxed Jinja environment with HF's globals (``raise_exception``, ``tojson``,
   ``strftime_now``) and variables (``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``tools``,
   and the thinking switch under both names templates use, ``thinking`` and ``enable_thinking``);
2. a ``"chat_format"`` key of ours in ``tokenizer_config.json`` naming a built-in format (``BUILTIN_FORMATS``);
3. DeepSeek-V4.1's ``encoding/encoding.py``: that release ships Python encoding rules instead of a template (see
   `DeepSeekV41Format`); we never run the shipped code, we select our own renderer of the documented rules.

Both a template and a ``chat_format`` key is ambiguous and refused, as is a directory with neither.

Token ids: the rendered text is tokenized with the directory's ``tokenizer.json``; a special token the *format* wrote
(role markers, bos, ``</think>``) becomes its id, while a special token's string inside message text (what a client
sent) is encoded as ordinary characters, so no client can forge a turn boundary. That is the rule the default always
had; it is kept for every format by swapping such strings for private sentinels before rendering (`_Escaper`).
"""

from __future__ import annotations

import copy
import json
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
FORMAT_KEY = "chat_format"
DEEPSEEK_V41 = "deepseek-v4.1"
DEEPSEEK_V41_ENCODING = "encoding/encoding.py"  # what the V4.1 release ships instead of a chat template
TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")

# What a continuing session already holds when the caller does not: one finished exchange. A message's ids after it
# are what that message adds to any conversation past its first exchange (see ChatFormat.append).
STAND_IN = ({"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hello!"})


class ChatFormatError(ValueError):
    """A conversation the format cannot render (unknown role, a template that raised, ...) or a directory without a
    usable format. Callers answer it as the client's error (a 400), never as a server fault."""


class NoChatFormat(ChatFormatError):
    """The directory selects no format at all (as opposed to a broken one): plain text still works there."""


@dataclass(frozen=True)
class Message:
    role: str
    content: str


class Renderer(Protocol):
    """Conversation -> text. Messages arrive as plain dicts, already escaped (see `_Escaper`)."""

    name: str
    special_tokens: Mapping[str, str]  # bos_token, eos_token, ... as the format writes them

    def render(self, messages: list[dict], add_generation_prompt: bool, thinking: bool | None, tools: list | None,
               options: dict[str, Any]) -> str: ...


# ---------------------------------------------------------------------------------------------------- plain text
class PlainText:
    """Text -> ids where every added token's string is encoded as characters, not as the control token.

    A special string is encoded as its first character, then the rest: the split the default has always used, so the
    ids of such text are unchanged (and the string cannot re-form the token under BPE)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.specials = tuple(sorted({t.content for t in tokenizer.get_added_tokens_decoder().values()}, key=len,
                                     reverse=True))
        self.pattern = re.compile("|".join(map(re.escape, self.specials))) if self.specials else None

    def encode(self, text: str) -> list[int]:
        if self.pattern is None:
            return self._ids(text)
        ids: list[int] = []
        pos = 0
        for m in self.pattern.finditer(text):
            ids += self._ids(text[pos:m.start()]) + self.as_text(m.group())
            pos = m.end()
        return ids + self._ids(text[pos:])

    def as_text(self, special: str) -> list[int]:
        return self._ids(special[0]) + self.encode(special[1:])

    def _ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids if text else []


class _Escaper:
    """Swaps every special-token string in client-supplied values for a sentinel (private-use characters around a
    per-render random nonce and an index), so the rendered text says where message text held one."""

    OPEN, CLOSE = "\ue000", "\ue001"

    def __init__(self, pattern: re.Pattern[str] | None, inputs: Any) -> None:
        self.pattern = pattern
        self.found: list[str] = []
        seen = json.dumps(inputs, ensure_ascii=False, default=str)
        self.nonce = secrets.token_hex(6)
        while self.OPEN + self.nonce in seen:  # a client cannot guess it, but never reuse one that occurs
            self.nonce = secrets.token_hex(6)
        self.sentinel = re.compile(re.escape(self.OPEN + self.nonce) + r"(\d+)" + re.escape(self.CLOSE))

    def value(self, v: Any) -> Any:
        if isinstance(v, str):
            return self.pattern.sub(self._mark, v) if self.pattern is not None else v
        if isinstance(v, Mapping):
            return {k: self.value(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [self.value(x) for x in v]
        return v

    def message(self, m: dict) -> dict:
        return {k: (v if k == "role" else self.value(v)) for k, v in m.items()}  # a role is the format's vocabulary

    def _mark(self, m: re.Match[str]) -> str:
        self.found.append(m.group())
        return f"{self.OPEN}{self.nonce}{len(self.found) - 1}{self.CLOSE}"

    def restore(self, text: str) -> str:
        return self.sentinel.sub(lambda m: self.found[int(m.group(1))], text)


# ---------------------------------------------------------------------------------------------------- Jinja templates
class _TemplateRefusal(jinja2.TemplateError):
    """What `raise_exception` raises: the template's own refusal of the conversation."""


def _raise_exception(message: str) -> None:
    raise _TemplateRefusal(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """HF's `tojson`: unlike Jinja's own it neither HTML-escapes nor forces ASCII (templates rely on both)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders its body unchanged, so templates
    written for training masks still compile."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body", []), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    """The environment HF's `apply_chat_template` uses: sandboxed (a template is data from the model directory and
    must not reach Python), trim_blocks/lstrip_blocks, loop controls, and its globals."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class JinjaTemplate:
    """A chat template in the HF convention, compiled once."""

    name = "chat_template"

    def __init__(self, source: str | list, special_tokens: Mapping[str, str], where: str) -> None:
        self.special_tokens = dict(special_tokens)
        self.where = where
        named = {"default": source} if isinstance(source, str) else _named_templates(source, where)
        env = _environment()
        self.sources: dict[str, str] = named
        self.templates: dict[str, jinja2.Template] = {}
        for key, text in named.items():
            try:
                self.templates[key] = env.from_string(text)
            except jinja2.TemplateSyntaxError as exc:
                raise ChatFormatError(f"{where}: chat template {key!r} does not compile: {exc.message} "
                                      f"(line {exc.lineno})") from None
        if "default" not in self.templates:
            raise ChatFormatError(f"{where}: the named chat templates {sorted(named)} have no 'default'")

    @property
    def source(self) -> str:
        return self.sources["default"]

    def render(self, messages: list[dict], add_generation_prompt: bool, thinking: bool | None, tools: list | None,
               options: dict[str, Any]) -> str:
        template = self.templates["tool_use"] if tools and "tool_use" in self.templates else self.templates["default"]
        variables: dict[str, Any] = {**options, **self.special_tokens, "messages": messages,
                                     "add_generation_prompt": add_generation_prompt}
        if tools is not None:
            variables["tools"] = tools
        if thinking is not None:
            variables["thinking"] = variables["enable_thinking"] = thinking
        try:
            return template.render(**variables)
        except _TemplateRefusal as exc:
            raise ChatFormatError(f"the chat template refused the conversation: {exc.message}") from None
        except Exception as exc:  # noqa: BLE001 - any failure inside the template is the conversation's, reported as such
            raise ChatFormatError(f"the chat template failed on this conversation: "
                                  f"{type(exc).__name__}: {exc}") from None


def _named_templates(source: list, where: str) -> dict[str, str]:
    """HF's list form: [{"name": ..., "template": ...}, ...] ("tool_use" is picked when tools are passed)."""
    if not all(isinstance(t, Mapping) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
               for t in source):
        raise ChatFormatError(f"{where}: chat_template must be a string or a list of {{'name', 'template'}} objects")
    return {t["name"]: t["template"] for t in source}


# ---------------------------------------------------------------------------------------------------- DeepSeek-V4.1
class DeepSeekV41Format:
    """Our renderer of DeepSeek-V4.1's chat format (built-in ``"deepseek-v4.1"``).

    What the release ships: DeepSeek-V4.1-Flash has no Jinja chat template; its model repository carries an
    ``encoding/`` folder (``encoding.py``, ``README.md``, ``test_encoding.py``, ``tests/test_input_*.json`` with
    ``test_output_*.txt`` goldens) of Python rules, as V4 (``encoding/encoding_dsv4.py``) and V3.2
    (``encoding_dsv32.py``) did. This class is written from those documented rules, not from the shipped code. Sources
    read: the release's ``encoding/README.md`` and tests as summarised by llm-wiki notes on "DeepSeek-V4.1 chat, tool,
    and reasoning encoding"; sglang's port ``python/sglang/srt/entrypoints/openai/encoding_dsv41.py`` ("adapted from the
    DeepSeek-V4.1 release reference implementation"); and renderers checked byte-for-byte against the official
    ``encoding.py`` (C, Rust, Python test goldens quoted in public repositories). The rules:

    - the prompt starts with ``<｜begin▁of▁sentence｜>``; ``<｜System｜>``, ``<｜User｜>``, ``<｜Assistant｜>`` mark
      turns and ``<｜end▁of▁sentence｜>`` ends every assistant message (it is the end-of-turn token generation stops
      at);
    - thinking on: the first turn opens with ``<｜System｜>Reasoning Effort: N (range 1-100, the higher the value, the
      more thorough the reasoning)\\n\\n`` (N an int 1..100 or ``low``/``high``/``max`` = 50/75/100, default ``high``)
      followed by the first system message's text if there is one; thinking off: no effort line, and a leading system
      message is ``<｜System｜>`` + text;
    - a system message after the first turn carries its own ``<｜System｜>`` and, like a user message, may end the
      input;
    - a user message (or that later system message) directly followed by an assistant message, or ending the prompt,
      is followed by ``<｜Assistant｜>`` then ``<think>`` (thinking on, for turns from the last user message on) or
      ``</think>`` (thinking off; and, thinking on, for earlier turns whose reasoning is dropped);
    - an assistant message is ``[reasoning</think>]content[tool calls]<｜end▁of▁sentence｜>``; the reasoning part is
      written only with thinking on for messages after the last user message, unless ``drop_thinking=False``;
    - tool calls: ``\\n\\n<｜DSML｜ calls>\\n`` + invokes joined by ``\\n`` + ``\\n</｜DSML｜ calls>``, an invoke being
      ``<｜DSML｜ invoke name="NAME">\\n`` + parameters joined by ``\\n`` + ``\\n</｜DSML｜ invoke>`` and a parameter
      ``<｜DSML｜ parameter name="K" string="true|false">V</｜DSML｜ parameter>`` (strings as is, other values as JSON);
    - there is no tool role: tool results become ``<tool_result>TEXT</tool_result>`` blocks of a user turn, ordered as
      the preceding assistant's calls; consecutive user/tool messages form one user turn, parts joined by ``\\n\\n``.

    Our additions: ``add_generation_prompt=False`` leaves out the assistant header after a final user/system message
    (the rules always write it), so the text of a history can be a prefix of the next prompt; ``tools`` are written
    into the first system turn (after the first system message's text and a blank line, or alone), as our own prompt
    text (`TOOLS_PROMPT`: how to write a DSML call, then each function as JSON on a line of its own; the release's
    exact text is not reproduced). Left out: ``response_format``, quick-instruction tasks, images,
    tool namespaces, the ``latest_reminder`` and ``developer`` roles: each is refused, never silently dropped.

    One open point: sglang's port maps ``low``/``high``/``xhigh``/``max`` to 25/50/75/100 with ``high`` (50) the
    default, while the release notes and the goldens we found say 50/75/100, default 75; we follow the latter, and an
    integer effort renders the same either way.
    """

    name = DEEPSEEK_V41
    BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    SYSTEM, USER, ASSISTANT = "<｜System｜>", "<｜User｜>", "<｜Assistant｜>"
    THINK, END_THINK = "<think>", "</think>"
    DSML = "｜DSML｜"
    EFFORTS = {"low": 50, "high": 75, "max": 100}
    DEFAULT_EFFORT = "high"
    EFFORT_LINE = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
    ROLES = ("assistant", "system", "tool", "user")
    OPTIONS = ("reasoning_effort", "drop_thinking")
    REQUIRED_TOKENS = (BOS, EOS, SYSTEM, USER, ASSISTANT, THINK, END_THINK)
    # ours, in the shape of the V3.2/V4 releases' tool prompt (their exact text is not reproduced here)
    TOOLS_PROMPT = ("## Tools\n\nYou can call the tools listed below. "
                    "To call tools, end your reply with a block like this:\n"
                    "<{dsml} calls>\n<{dsml} invoke name=\"TOOL_NAME\">\n"
                    "<{dsml} parameter name=\"PARAMETER_NAME\" string=\"true|false\">VALUE</{dsml} parameter>\n...\n"
                    "</{dsml} invoke>\n...\n</{dsml} calls>\n\n"
                    "A string value is written as it is, with string=\"true\"; "
                    "any other value as JSON, with string=\"false\". "
                    "Each call's result comes back in the next user turn as <tool_result>...</tool_result>, "
                    "in the order of the calls.\n\n### Available tools\n\n")

    def __init__(self, special_tokens: Mapping[str, str] | None = None) -> None:
        """The format writes its own bos/eos; the directory's pad/unk tokens are kept for the ids callers need."""
        others = {k: v for k, v in (special_tokens or {}).items() if k in ("pad_token", "unk_token")}
        self.special_tokens = {"bos_token": self.BOS, "eos_token": self.EOS, **others}

    def render(self, messages: list[dict], add_generation_prompt: bool, thinking: bool | None, tools: list | None,
               options: dict[str, Any]) -> str:
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            raise ChatFormatError(f"the {self.name} format has no option {unknown}; it takes {list(self.OPTIONS)}")
        tools_text = self._tools(tools) if tools else ""
        think = bool(thinking)
        effort = self._effort(options.get("reasoning_effort")) if think else None
        drop = think and bool(options.get("drop_thinking", True))
        turns = self._turns(messages)
        last_user = max((i for i, t in enumerate(turns) if t["role"] == "user" or (t["role"] == "system" and i > 0)),
                        default=-1)
        out = [self.BOS]
        for i, turn in enumerate(turns):
            role = turn["role"]
            if i == 0 and (effort is not None or role == "system" or tools_text):
                out.append(self.SYSTEM)
            if i == 0 and effort is not None:
                out.append(self.EFFORT_LINE.format(effort))
            if role == "system":
                out.append((self.SYSTEM if i > 0 else "") + turn["content"])
            if i == 0 and tools_text:  # after the first system message's text, before the first user turn
                out.append(("\n\n" if role == "system" and turn["content"] else "") + tools_text)
            if role == "user":
                out.append(self.USER + "\n\n".join(turn["parts"]))
            elif role == "assistant":
                reasoning = think and (not drop or i > last_user)
                out.append((turn["reasoning"] + self.END_THINK if reasoning else "") + turn["content"] + turn["calls"]
                           + self.EOS)
            following = turns[i + 1]["role"] if i + 1 < len(turns) else None
            asks = role == "user" or (role == "system" and i > 0)
            if asks and (following == "assistant" or (following is None and add_generation_prompt)):
                out.append(self.ASSISTANT + (self.THINK if think and (not drop or i >= last_user) else self.END_THINK))
        return "".join(out)

    def _tools(self, tools: list) -> str:
        """The tool schemas' system text: how to call (the DSML syntax `_calls` writes), then each function as JSON."""
        fns = []
        for i, tool in enumerate(tools):
            fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise ChatFormatError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
            fns.append(json.dumps(dict(fn), ensure_ascii=False))
        return self.TOOLS_PROMPT.format(dsml=self.DSML) + "\n".join(fns)

    def _effort(self, value: Any) -> int:
        value = self.DEFAULT_EFFORT if value is None else value
        if type(value) is int and 1 <= value <= 100:
            return value
        if isinstance(value, str) and value in self.EFFORTS:
            return self.EFFORTS[value]
        raise ChatFormatError(f"reasoning_effort {value!r} is not an integer 1..100 or one of {list(self.EFFORTS)}")

    def _turns(self, messages: list[dict]) -> list[dict]:
        """Messages -> turns: tool results and user text merged into user turns, tool calls rendered."""
        turns: list[dict] = []
        call_order: dict[str, int] = {}
        for i, m in enumerate(messages):
            role = m.get("role")
            if role not in self.ROLES:
                raise ChatFormatError(f"unknown chat role {role!r} for the {self.name} format; "
                                      f"expected one of {list(self.ROLES)}")
            if role in ("user", "tool"):
                if not (turns and turns[-1]["role"] == "user"):
                    turns.append({"role": "user", "parts": [], "order": []})
                text = _text(m.get("content"), i, role)
                if role == "tool":
                    turns[-1]["parts"].append(f"<tool_result>{text}</tool_result>")
                    turns[-1]["order"].append(call_order.get(str(m.get("tool_call_id") or ""), 0))
                else:
                    turns[-1]["parts"].append(text)
                    turns[-1]["order"].append(None)
            elif role == "system":
                turns.append({"role": "system", "content": _text(m.get("content"), i, role)})
            else:
                calls = m.get("tool_calls") or []
                # results after it are ordered as these calls (until the next calls)
                if calls and isinstance(calls, list):
                    call_order = {str(c.get("id")): k for k, c in enumerate(calls)
                                  if isinstance(c, Mapping) and c.get("id")}
                turns.append({"role": "assistant", "content": _text(m.get("content"), i, role),
                              "reasoning": _text(m.get("reasoning_content"), i, "reasoning"),
                              "calls": self._calls(calls, i)})
        for t in turns:
            if t["role"] == "user":
                _sort_tool_results(t)
        return turns

    def _calls(self, calls: Any, i: int) -> str:
        if not calls:
            return ""
        if not isinstance(calls, list):
            raise ChatFormatError(f"messages[{i}].tool_calls must be a list")
        invokes = []
        for call in calls:
            fn = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise ChatFormatError(f"messages[{i}].tool_calls: each call needs function.name and function.arguments")
            args = fn.get("arguments") or {}
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError as exc:
                    raise ChatFormatError(f"messages[{i}].tool_calls: arguments of {fn['name']!r} are not JSON: "
                                          f"{exc.msg}") from None
            if not isinstance(args, Mapping):
                raise ChatFormatError(f"messages[{i}].tool_calls: arguments of {fn['name']!r} must be a JSON object")
            params = [f'<{self.DSML} parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                      f'{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</{self.DSML} parameter>'
                      for k, v in args.items()]
            invokes.append(f'<{self.DSML} invoke name="{fn["name"]}">\n' + "\n".join(params)
                           + f"\n</{self.DSML} invoke>")
        return f"\n\n<{self.DSML} calls>\n" + "\n".join(invokes) + f"\n</{self.DSML} calls>"


def _text(content: Any, i: int, what: str) -> str:
    """A message's text: a string, nothing (""), or OpenAI text parts (joined by a blank line, as the release does)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str)
                                         for p in content):
        return "\n\n".join(p["text"] for p in content)
    raise ChatFormatError(f"messages[{i}] ({what}): content must be a string or a list of text parts")


def _sort_tool_results(turn: dict) -> None:
    """Tool results in the order of the calls that asked for them (text parts keep their places)."""
    slots = [k for k, o in enumerate(turn["order"]) if o is not None]
    ordered = sorted(slots, key=lambda k: turn["order"][k])  # stable: unknown ids (order 0) keep their relative order
    parts = list(turn["parts"])
    for slot, src in zip(slots, ordered):
        parts[slot] = turn["parts"][src]
    turn["parts"] = parts


BUILTIN_FORMATS: dict[str, Callable[[Mapping[str, str]], Renderer]] = {DEEPSEEK_V41: DeepSeekV41Format}


# ---------------------------------------------------------------------------------------------------- the format
class ChatFormat:
    """A conversation -> text (`render`) -> token ids (`encode`), and one message's ids after a history (`append`)."""

    def __init__(self, tokenizer: Tokenizer, renderer: Renderer, source: str = "") -> None:
        self.tokenizer, self.renderer, self.source = tokenizer, renderer, source
        self.text = PlainText(tokenizer)
        missing = [t for t in getattr(renderer, "REQUIRED_TOKENS", ()) if tokenizer.token_to_id(t) is None]
        if missing:
            raise ChatFormatError(f"{source}: tokenizer.json lacks the special tokens the {renderer.name} format "
                                  f"writes: {missing}")
        tokens = renderer.special_tokens
        eos = tokens.get("eos_token")
        if not eos or tokenizer.token_to_id(eos) is None:
            raise ChatFormatError(f"{source}: the chat format's eos_token {eos!r} (the end of an assistant turn) "
                                  "is not a token of tokenizer.json")
        self.end_of_turn_id: int = tokenizer.token_to_id(eos)
        self.bos_id: int | None = tokenizer.token_to_id(tokens["bos_token"]) if tokens.get("bos_token") else None
        self.pad_id: int | None = tokenizer.token_to_id(tokens["pad_token"]) if tokens.get("pad_token") else None

    @property
    def name(self) -> str:
        return self.renderer.name

    @property
    def template(self) -> str | None:
        """The Jinja source when the format is a chat template (what HF-style frontends need), else None."""
        return self.renderer.source if isinstance(self.renderer, JinjaTemplate) else None

    @classmethod
    def load(cls, model_dir: str | Path, tokenizer: Tokenizer | None = None) -> "ChatFormat":
        """The format `model_dir`'s files select (see the module docstring); `tokenizer` defaults to its
        tokenizer.json."""
        model_dir = Path(model_dir)
        if tokenizer is None:
            if not (model_dir / TOKENIZER_FILE).is_file():
                raise ChatFormatError(f"{model_dir / TOKENIZER_FILE} not found")
            tokenizer = Tokenizer.from_file(str(model_dir / TOKENIZER_FILE))
        return cls(tokenizer, select_renderer(model_dir), str(model_dir))

    # ------------------------------------------------------------------ conversations
    def render(self, messages: Sequence[Message | Mapping], *, add_generation_prompt: bool = True,
               thinking: bool | None = None, tools: list | None = None, **options: Any) -> str:
        """The conversation's prompt text (special-token strings in message text appear as sent)."""
        escaper, text = self._render(messages, add_generation_prompt, thinking, tools, options)
        return escaper.restore(text)

    def encode(self, messages: Sequence[Message | Mapping], *, add_generation_prompt: bool = True,
               thinking: bool | None = None, tools: list | None = None, **options: Any) -> list[int]:
        """The conversation's prompt ids. `add_generation_prompt`: end with the assistant's header (a reply is wanted).
        `thinking`: the format's thinking switch (None: the format's default). `options` go to the format (template
        variables; the DeepSeek format's `reasoning_effort`, `drop_thinking`)."""
        escaper, text = self._render(messages, add_generation_prompt, thinking, tools, options)
        ids: list[int] = []
        pos = 0
        for m in escaper.sentinel.finditer(text):
            ids += self._special_aware(text[pos:m.start()], escaper) + self.text.as_text(escaper.found[int(m.group(1))])
            pos = m.end()
        return ids + self._special_aware(text[pos:], escaper)

    def append(self, history: Sequence[Message | Mapping] | None,
               message: Message | Mapping | Sequence[Message | Mapping], *,
               add_generation_prompt: bool = True, thinking: bool | None = None, tools: list | None = None,
               **options: Any) -> list[int]:
        """The ids `message` adds after `history` (a turn sent to a session that holds the history). `message` may be a
        list of messages that form the turn together (tool results, say).

        `history=None`: after an earlier conversation the caller does not hold (a continuing session); the ids are
        taken after a stand-in exchange (`STAND_IN`). Refused when the format renders the history differently once
        the message follows it (e.g. DeepSeek's thinking mode drops earlier reasoning): such a turn cannot be sent on
        its own, only the whole conversation."""
        earlier = list(STAND_IN if history is None else history)
        kw = dict(thinking=thinking, tools=tools, **options)
        before = self.encode(earlier, add_generation_prompt=False, **kw)
        added = list(message) if isinstance(message, (list, tuple)) else [message]
        after = self.encode([*earlier, *added], add_generation_prompt=add_generation_prompt, **kw)
        if after[:len(before)] != before:
            raise ChatFormatError(f"the {self.name} format renders the earlier conversation differently once this "
                                  "message follows it, so the message cannot be encoded as a turn of its own; send the "
                                  "whole conversation")
        return after[len(before):]

    def _render(self, messages: Sequence[Message | Mapping], add_generation_prompt: bool, thinking: bool | None,
                tools: list | None, options: dict[str, Any]) -> tuple[_Escaper, str]:
        plain = [_as_dict(m, i) for i, m in enumerate(messages)]
        escaper = _Escaper(self.text.pattern, [plain, tools, options])
        escaped = [escaper.message(m) for m in plain]
        text = self.renderer.render(escaped, bool(add_generation_prompt), thinking,
                                    escaper.value(tools) if tools is not None else None,
                                    {k: escaper.value(v) for k, v in options.items()})
        if not isinstance(text, str):
            raise ChatFormatError(f"the {self.name} format rendered {type(text).__name__}, not text")
        return escaper, text

    def _special_aware(self, segment: str, escaper: _Escaper) -> list[int]:
        """Format-written text: special strings here are the format's own tokens."""
        if escaper.OPEN + escaper.nonce in segment:
            raise ChatFormatError(f"the {self.name} format altered message text that holds special-token strings, "
                                  "so it cannot keep them as plain text")
        return self.tokenizer.encode(segment, add_special_tokens=False).ids if segment else []


def _as_dict(m: Message | Mapping, i: int) -> dict:
    if isinstance(m, Message):
        return {"role": m.role, "content": m.content}
    if isinstance(m, Mapping):
        return copy.deepcopy(dict(m))
    raise ChatFormatError(f"messages[{i}] must be a message object with 'role' and 'content', got {type(m).__name__}")


# ---------------------------------------------------------------------------------------------------- selection
def read_tokenizer_config(model_dir: Path) -> dict:
    path = model_dir / TOKENIZER_CONFIG
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ChatFormatError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ChatFormatError(f"{path} must hold a JSON object")
    return cfg


def special_tokens_of(cfg: Mapping) -> dict[str, str]:
    """bos_token, eos_token, ... of a tokenizer_config (a string, or HF's {"__type": "AddedToken", "content": ...})."""
    out = {}
    for key in TOKEN_KEYS:
        value = cfg.get(key)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str) and value:
            out[key] = value
    return out


def select_renderer(model_dir: Path) -> Renderer:
    """The renderer `model_dir`'s files select (order: a chat template, our chat_format key, DeepSeek's encoding/)."""
    cfg = read_tokenizer_config(model_dir)
    tokens = special_tokens_of(cfg)
    template: Any = cfg.get("chat_template")
    where = str(model_dir / TOKENIZER_CONFIG)
    if template is None and (model_dir / TEMPLATE_FILE).is_file():
        template, where = (model_dir / TEMPLATE_FILE).read_text(encoding="utf-8"), str(model_dir / TEMPLATE_FILE)
    named = cfg.get(FORMAT_KEY)
    if template is not None and named is not None:
        raise ChatFormatError(f"{model_dir}: both a chat template and {FORMAT_KEY}={named!r}; "
                              "keep one so the format is not a guess")
    if template is not None:
        if not isinstance(template, (str, list)) or not template:
            raise ChatFormatError(f"{where}: chat_template must be a non-empty string or list of named templates")
        return JinjaTemplate(template, tokens, where)
    if named is not None:
        if named not in BUILTIN_FORMATS:
            raise ChatFormatError(f"{model_dir / TOKENIZER_CONFIG}: unknown {FORMAT_KEY} {named!r}; built-in formats: "
                                  f"{sorted(BUILTIN_FORMATS)}")
        return BUILTIN_FORMATS[named](tokens)
    if (model_dir / DEEPSEEK_V41_ENCODING).is_file():
        return BUILTIN_FORMATS[DEEPSEEK_V41](tokens)
    shipped = sorted(p.name for p in (model_dir / "encoding").glob("*.py")) if (model_dir / "encoding").is_dir() else []
    if shipped:
        raise ChatFormatError(f"{model_dir}: ships encoding rules {shipped} that no built-in format implements "
                              f"(built-in: {sorted(BUILTIN_FORMATS)}); name one with a {FORMAT_KEY!r} key in "
                              f"{TOKENIZER_CONFIG} if it applies")
    raise NoChatFormat(f"{model_dir}: no chat format: {TOKENIZER_CONFIG} has no chat_template and no {FORMAT_KEY!r} "
                       f"key, there is no {TEMPLATE_FILE} and no {DEEPSEEK_V41_ENCODING}; "
                       f"built-in formats: {sorted(BUILTIN_FORMATS)}")

