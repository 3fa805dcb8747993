"""DeepSeek-V4.1's chat format as a Jinja chat template, for frontends that render templates only (Dynamo's).

The release ships Python encoding rules, not a template, and our renderer of them (`chat_format.DeepSeekV41Format`)
is what the serving path uses. A stateless frontend that tokenizes the conversation itself (Dynamo's OpenAI frontend
runs HF-style chat templates) needs the same rules as a template, or its prompts would not be the ids the workers'
sessions hold. This template writes the part of the rules such a frontend needs for chat: system, user and assistant
text with thinking off (the renderer's default). Anything else (tool calls and results, thinking on, tool schemas) is
refused by the template with a message, never rendered another way; `tests/ced/text/test_deepseek_template.py`
checks it equals the renderer, character for character, on every conversation it accepts.
"""

from __future__ import annotations

from ced.text.chat_format import DeepSeekV41Format as F

# a user message (or a system message after the first) that an assistant message follows, or that ends a prompt asking
# for a reply, gets the assistant header with thinking off; consecutive user messages are one turn, joined by a blank
# line
DEEPSEEK_V41_CHAT_TEMPLATE = (
    "{%- if tools or enable_thinking or thinking -%}"
    "{{ raise_exception('this template renders DeepSeek-V4.1 chat without tools and with thinking off') }}"
    "{%- endif -%}"
    "{{- bos_token -}}"
    "{%- set ns = namespace(prev='', first=true) -%}"
    "{%- for m in messages -%}"
    "{%- if m.content is not string -%}{{ raise_exception('message content must be a string here') }}{%- endif -%}"
    "{%- if m.role == 'user' -%}"
    "{%- if ns.prev == 'user' -%}{{ '\\n\\n' + m.content }}{%- else -%}{{ '" + F.USER + "' + m.content }}{%- endif -%}"
    "{%- set ns.prev = 'user' -%}"
    "{%- elif m.role == 'system' -%}"
    "{{ '" + F.SYSTEM + "' + m.content }}"
    "{%- set ns.prev = 'system_first' if ns.first else 'system' -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- if m.tool_calls -%}{{ raise_exception('tool calls are not rendered by this template') }}{%- endif -%}"
    "{%- if ns.prev in ['user', 'system'] -%}{{ '" + F.ASSISTANT + F.END_THINK + "' }}{%- endif -%}"
    "{{ m.content + '" + F.EOS + "' }}"
    "{%- set ns.prev = 'assistant' -%}"
    "{%- else -%}{{ raise_exception('role ' + m.role + ' is not rendered by this template') }}"
    "{%- endif -%}"
    "{%- set ns.first = false -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt and ns.prev in ['user', 'system'] -%}"
    "{{ '" + F.ASSISTANT + F.END_THINK + "' }}{%- endif -%}"
)
