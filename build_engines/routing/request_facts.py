"""Structured facts read out of the prepared domain documents: what a user could ask about.

A user asks about a command and its flags, a Python function and what its docstring says, a CSS property on a
selector, or just chats. The document-window routing items show the router raw excerpts only, so it learned "prose
goes to chat". These extractors turn each document into facts (plain dicts of strings) that the request phrasings
(`request_phrasings`) fill in; nothing here is random, so the same document always gives the same facts.

- agent (man pages, groff converted to indented text): the command and its one-line summary from NAME, a usage
  line from SYNOPSIS, and every option entry (the flag and the first sentence of its description).
- code (stdlib modules): every public `def`/`class` that has a docstring: the dotted module, the name, the
  argument list, the docstring's first sentence, and the definition's first lines as a snippet.
- design (CSS/SCSS): every declaration of a known CSS property with a literal value (no `$var` or `@mixin`
  arguments), with the rule's selector and a few lines of the rule as a snippet.
- chat (movie dialogues): every utterance of 4-30 words without its speaker tag.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

Fact = dict[str, str]

MAX_SNIPPET_CHARS = 220
MAX_SENTENCE_CHARS = 110

# The properties a user names; each with how a user says what it controls (used by the "phrase" fields).
CSS_PROPERTY_PHRASES: dict[str, str] = {
    "display": "how an element is displayed (block, inline, flex or grid)",
    "justify-content": "horizontal alignment of items in a flex container",
    "align-items": "vertical alignment of flex items",
    "align-content": "spacing between the rows of a flex or grid container",
    "align-self": "the alignment of a single flex item",
    "flex": "how a flex item grows and shrinks",
    "flex-direction": "the direction flex items are laid out in",
    "flex-wrap": "whether flex items wrap onto new lines",
    "flex-flow": "the direction and wrapping of flex items",
    "flex-grow": "how much a flex item grows",
    "flex-shrink": "how much a flex item shrinks",
    "flex-basis": "the starting size of a flex item",
    "grid-template-columns": "the columns of a grid layout",
    "grid-template-rows": "the rows of a grid layout",
    "grid-gap": "the gap between grid cells",
    "gap": "the gap between grid or flex items",
    "margin": "the space outside an element",
    "margin-top": "the space above an element",
    "margin-bottom": "the space below an element",
    "margin-left": "the space to the left of an element",
    "margin-right": "the space to the right of an element",
    "padding": "the space inside an element around its content",
    "padding-top": "the inner space at the top of an element",
    "padding-bottom": "the inner space at the bottom of an element",
    "padding-left": "the inner space on the left of an element",
    "padding-right": "the inner space on the right of an element",
    "color": "the text colour",
    "background": "the background of an element",
    "background-color": "the background colour",
    "background-image": "a background image",
    "background-size": "how big the background image is drawn",
    "background-position": "where the background image sits",
    "border": "the border around an element",
    "border-color": "the colour of a border",
    "border-width": "the thickness of a border",
    "border-style": "the line style of a border",
    "border-bottom": "the bottom border",
    "border-top": "the top border",
    "border-radius": "rounded corners",
    "box-shadow": "a drop shadow around a box",
    "text-shadow": "a shadow behind text",
    "font-size": "the size of the text",
    "font-weight": "how bold the text is",
    "font-family": "the typeface",
    "font-style": "italic text",
    "line-height": "the spacing between lines of text",
    "letter-spacing": "the spacing between letters",
    "text-align": "the alignment of text",
    "text-decoration": "underlines on text",
    "text-transform": "upper- or lower-case text",
    "text-overflow": "how cut-off text is shown",
    "white-space": "how whitespace and line wrapping are handled",
    "word-wrap": "breaking long words",
    "vertical-align": "vertical alignment of inline content",
    "width": "the width of an element",
    "height": "the height of an element",
    "max-width": "the maximum width of an element",
    "min-width": "the minimum width of an element",
    "max-height": "the maximum height of an element",
    "min-height": "the minimum height of an element",
    "position": "how an element is positioned (relative, absolute, fixed, sticky)",
    "top": "the offset from the top for a positioned element",
    "left": "the offset from the left for a positioned element",
    "right": "the offset from the right for a positioned element",
    "bottom": "the offset from the bottom for a positioned element",
    "z-index": "which element is stacked on top",
    "overflow": "what happens to content that overflows its box",
    "overflow-x": "horizontal scrolling of overflowing content",
    "overflow-y": "vertical scrolling of overflowing content",
    "opacity": "the transparency of an element",
    "visibility": "hiding an element while keeping its space",
    "cursor": "the mouse cursor over an element",
    "transition": "animating changes of a property",
    "transform": "rotating, scaling or moving an element",
    "animation": "a keyframe animation",
    "animation-name": "which keyframe animation runs",
    "animation-duration": "how long an animation takes",
    "content": "generated content in a pseudo-element",
    "list-style": "the bullets of a list",
    "outline": "the focus outline",
    "box-sizing": "whether padding and border count in the width",
    "float": "floating an element to the left or right",
    "clear": "clearing floats",
    "user-select": "whether text can be selected",
    "pointer-events": "whether an element reacts to the mouse",
    "fill": "the fill colour of an SVG icon",
    "object-fit": "how an image fits its box",
    "table-layout": "how table columns are sized",
    "border-collapse": "collapsing table borders",
    "appearance": "the native look of form controls",
    "resize": "whether the user can resize an element",
}

_WORD = re.compile(r"[A-Za-z]")
# First words that show a description is not a verb phrase ("minimum size of...", "the file to read"), so it
# cannot follow "how do I ..." or "a function to ...".
_NOT_VERBS = frozenset("a an the this that these those if when with without for by as see same like default "
                       "minimum maximum number size line alias synonym deprecated equivalent obsolete only-if "
                       "deprecated, note one all each any no not base helper internal".split())


def as_verb_phrase(text: str) -> str:
    """`text` as an imperative verb phrase ("Returns the size" -> "return the size"), or "" when it does not
    start like one (see `_NOT_VERBS`)."""
    words = text.split()
    if not words or not words[0].isalpha():
        return ""
    first = words[0].lower()
    if first in _NOT_VERBS or first.endswith(("ly", "al", "ous", "ed", "ing", "ion")) or words[0][1:2].isupper():
        return ""
    if first.endswith("es") and first[:-2].endswith(("ss", "sh", "ch", "x")):
        first = first[:-2]
    elif first.endswith("s") and not first.endswith("ss"):
        first = first[:-1]
    return " ".join([first] + words[1:])


def first_sentence(text: str, limit: int = MAX_SENTENCE_CHARS) -> str:
    """The first sentence of `text` (whitespace collapsed, trailing period dropped), cut at a word to `limit`."""
    text = " ".join(text.split())
    match = re.search(r"(?<=[a-z0-9)\]'\"])[.;:](\s|$)", text)
    if match:
        text = text[: match.start()]
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0]
    return text.strip(" .,;:")


def lower_first(text: str) -> str:
    """`text` with a leading capital lowered unless it starts an acronym or a name with more capitals."""
    if len(text) > 1 and text[0].isupper() and not text[1].isupper():
        return text[0].lower() + text[1:]
    return text


# ------------------------------------------------------------------------------------------------------- agent


_OPTION = re.compile(r"^(-{1,2}[A-Za-z0-9?#@][\w\-=\[\]<>.|,]*)")


def man_facts(doc_id: str, text: str) -> list[Fact]:
    """One fact per option entry of a man page (plus one per page without options): cmd, summary, usage, option,
    option_desc (its description as a verb phrase, or empty), option2 (another option of the same page, for
    "difference" questions)."""
    lines = text.splitlines()
    section, name, summary, usage = "", "", "", ""
    options: list[tuple[str, str]] = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped:
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            section = stripped.upper()
            continue
        if section == "NAME" and not name and " - " in stripped:
            name, summary = (part.strip() for part in stripped.split(" - ", 1))
            name = name.split(",")[0].strip()
        elif section == "SYNOPSIS" and not usage:
            usage = stripped
        elif (match := _OPTION.match(stripped)) and section not in ("NAME", "SYNOPSIS"):
            flag = match.group(1).split(",")[0].split("=")[0].split("[")[0].rstrip(".")
            desc = []
            for follow in lines[i + 1:]:
                if not follow.strip():
                    if desc:
                        break
                    continue
                if len(follow) - len(follow.lstrip()) <= indent:
                    break
                desc.append(follow)
            sentence = first_sentence(" ".join(desc))
            if len(flag) > 1 and len(sentence.split()) >= 3 and _WORD.search(sentence):
                options.append((flag, as_verb_phrase(sentence)))
    if not name or not summary:
        return []
    name = name.split()[0]
    if "-" in name and usage.startswith(name.replace("-", " ", 1) + " "):  # git-log is typed `git log`
        name = name.replace("-", " ", 1)
    base = {"cmd": name, "summary": lower_first(first_sentence(summary)), "usage": usage or name, "doc": doc_id}
    if not options:
        return [base]
    facts = []
    seen: set[str] = set()
    for k, (flag, desc) in enumerate(options):
        if flag in seen:
            continue
        seen.add(flag)
        other = options[(k + 1) % len(options)][0]
        facts.append({**base, "option": flag, "option_desc": desc, "option2": other if other != flag else ""})
    return facts


# -------------------------------------------------------------------------------------------------------- code


_DEF = re.compile(r"^(\s*)(def|class)\s+([A-Za-z]\w*)\s*(\(([^)]*)\))?\s*(->[^:]*)?:\s*$")
_DOC_OPEN = re.compile(r'^\s*[rRuU]?("""|\'\'\')(.*)$')


def module_name(doc_id: str) -> str:
    """The dotted module of a stdlib document id (`asyncio/base_events#p002` -> `asyncio.base_events`)."""
    name = doc_id.split("#")[0].removesuffix("/__init__")
    return name.replace("/", ".")


def code_facts(doc_id: str, text: str) -> list[Fact]:
    """One fact per public function, method or class with a docstring: module, name, kind, args, purpose (a
    function docstring's first sentence as a verb phrase, or empty), snippet. `doc_id` is the corpus's own id
    (the module path)."""
    lines = text.splitlines()
    module = module_name(doc_id)
    facts = []
    for i, line in enumerate(lines):
        match = _DEF.match(line)
        if not match or i + 1 >= len(lines):
            continue
        indent, kind, name, _, args = match.group(1), match.group(2), match.group(3), match.group(4), match.group(5)
        if name.startswith("_"):
            continue
        opened = _DOC_OPEN.match(lines[i + 1])
        if not opened:
            continue
        quote, rest = opened.group(1), opened.group(2)
        body = [rest.split(quote)[0]]
        if quote not in rest:
            for follow in lines[i + 2: i + 8]:
                body.append(follow.split(quote)[0])
                if quote in follow or not follow.strip():
                    break
        doc = first_sentence(" ".join(body))
        if len(doc.split()) < 3 or not _WORD.search(doc):
            continue
        arglist = ", ".join(a.split("=")[0].split(":")[0].strip() for a in (args or "").split(",")
                            if a.strip() and a.strip() not in ("self", "cls"))
        snippet = textwrap.dedent("\n".join(lines[i: i + 6])).strip()
        facts.append({"module": module, "name": name, "kind": "class" if kind == "class" else "function",
                      "args": arglist, "purpose": as_verb_phrase(doc) if kind == "def" else "",
                      "snippet": snippet[:MAX_SNIPPET_CHARS].rstrip(), "method": "yes" if indent else "",
                      "doc": doc_id})
    return facts


# ------------------------------------------------------------------------------------------------------ design


_DECL = re.compile(r"^\s*([a-z][a-z-]*)\s*:\s*([^;{}$@]+?)\s*(!important)?\s*;?\s*$")
_SELECTOR = re.compile(r"^\s*([^@${}/][^{}]*?)\s*\{\s*$")


def css_facts(doc_id: str, text: str) -> list[Fact]:
    """One fact per declaration of a known property with a literal value: property, value, selector, phrase,
    snippet (the selector line and up to 3 declarations of the rule)."""
    lines = text.splitlines()
    facts = []
    selector, selector_line = "", -1
    for i, line in enumerate(lines):
        if sel := _SELECTOR.match(line):
            candidate = sel.group(1).strip().rstrip(",")
            selector = candidate if "#{" not in candidate and "&" not in candidate else ""
            selector_line = i
            continue
        if line.strip() == "}":
            selector = ""
            continue
        match = _DECL.match(line)
        if not match or not selector:
            continue
        prop, value = match.group(1), match.group(2).strip()
        if prop not in CSS_PROPERTY_PHRASES or "(" in value and ")" not in value or len(value) > 40:
            continue
        rule = [lines[selector_line].strip()] + [ln.strip() for ln in lines[selector_line + 1: i + 1]
                                                 if _DECL.match(ln)][-3:]
        snippet = "\n".join([rule[0]] + ["  " + ln for ln in rule[1:]] + ["}"])
        facts.append({"property": prop, "value": value, "selector": selector.split(",")[0].strip()[:60],
                      "phrase": CSS_PROPERTY_PHRASES[prop], "snippet": snippet[:MAX_SNIPPET_CHARS], "doc": doc_id})
    return facts


# -------------------------------------------------------------------------------------------------------- chat


_SPEAKER = re.compile(r"^[A-Z]:\s*")


def chat_facts(doc_id: str, text: str) -> list[Fact]:
    """One fact per dialogue utterance of 4-30 words (speaker tag dropped): utterance."""
    facts = []
    for line in text.splitlines():
        utterance = _SPEAKER.sub("", line).strip()
        if 4 <= len(utterance.split()) <= 30 and sum(ch.isalpha() for ch in utterance) >= 12:
            facts.append({"utterance": utterance, "doc": doc_id})
    return facts


# ------------------------------------------------------------------------------------------------------- drama
#
# The zero-shot fifth domain (Shakespeare's plays): no router head ever trains on it.

_SPEAKER_LINE = re.compile(r"^([A-Z][A-Z '&-]{2,30})\.$")


def play_title(doc_id: str) -> str:
    """`troilus_and_cressida#p002` -> `Troilus and Cressida`."""
    words = doc_id.split("#")[0].split("/")[-1].split("_")
    small = {"and", "of", "the", "in", "a"}
    return " ".join(w if i and w in small else w.capitalize() for i, w in enumerate(words))


def play_facts(doc_id: str, text: str) -> list[Fact]:
    """One fact per speech of 5-25 words on its first line: play, character (title case), line."""
    lines = text.splitlines()
    play = play_title(doc_id)
    facts = []
    for i, line in enumerate(lines[:-1]):
        match = _SPEAKER_LINE.match(line.strip())
        if not match:
            continue
        speech = lines[i + 1].strip()
        if speech.startswith("["):
            speech = speech.split("]", 1)[-1].strip()
        if 5 <= len(speech.split()) <= 25:
            facts.append({"play": play, "character": match.group(1).title(), "line": speech, "doc": doc_id})
    return facts


EXTRACTORS: dict[str, Any] = {"agent": man_facts, "code": code_facts, "design": css_facts, "chat": chat_facts,
                              "drama": play_facts}
