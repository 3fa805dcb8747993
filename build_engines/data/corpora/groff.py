"""A small man(7) groff to plain-text converter, written for the agent corpus of command-line manual pages.

Why our own: `man`/`groff` are not installed on every machine (and would have to come from Debian too), and we want
text, not a terminal rendering with overstrikes and page headers. The pages we read (help2man output, DocBook/
AsciiDoc output such as git's, hand-written pages such as bash's) use a small part of groff: the man macros,
a few requests, font and character escapes, tbl tables and DocBook's `.ie n`/`.el` list idiom; BSD pages (tmux,
OpenSSH) use mdoc(7) instead, of which the common semantic macros are handled. Everything else is dropped rather
than guessed. The layout follows `man`'s: section headings at the margin, body indented, option
tags on their own line with their description indented below them, example blocks verbatim.
Only the sections that teach how to use a tool are kept (NAME, SYNOPSIS, DESCRIPTION, OPTIONS, COMMANDS,
EXAMPLES, ...), so the corpus is not padded with AUTHORS, COPYRIGHT and SEE ALSO lists.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field

INDENT = 4
WIDTH = 80

KEEP_SECTION = re.compile(
    r"^(NAME|SYNOPSIS|DESCRIPTION|EXIT STATUS|RETURN VALUE|.*\b(OPTIONS?|COMMANDS?|EXAMPLES?|USAGE)\b.*)$")
# For tutorials and guides (git's section 7 pages) every section is content, except the usual trailer.
BOILERPLATE_SECTION = re.compile(
    r"^(AUTHORS?|COPYRIGHT|LICEN[CS]E|REPORTING BUGS|BUGS|SEE ALSO|HISTORY|COLOPHON|GIT|AVAILABILITY|"
    r"CONFORMING TO|STANDARDS|ACKNOWLEDGE?MENTS?|NOTES)$")


def usage_sections(title: str) -> bool:
    """The sections that teach how to use a command (the default filter)."""
    return bool(KEEP_SECTION.match(title))


def all_but_boilerplate(title: str) -> bool:
    """Every section but authors, copyright, bug reporting and cross references."""
    return not BOILERPLATE_SECTION.match(title)

# Named glyphs: \(xx and \[name]. Unknown names are dropped.
GLYPHS: dict[str, str] = {
    "hy": "-", "en": "-", "em": "--", "mi": "-", "aq": "'", "dq": '"', "lq": '"', "rq": '"', "oq": "'",
    "cq": "'", "bu": "*", "co": "(C)", "rg": "(R)", "tm": "(TM)", "mu": "x", "di": "/", "<=": "<=", ">=": ">=",
    "!=": "!=", "->": "->", "<-": "<-", "rA": "=>", "lA": "<=", "ti": "~", "ha": "^", "rs": "\\", "sl": "/",
    "ba": "|", "br": "|", "ga": "`", "aa": "'", "de": "°", "+-": "±", "sc": "§", "ps": "¶", "dg": "+",
    "pl": "+", "eq": "=", "fo": "<<", "fc": ">>", "Fo": "<<", "Fc": ">>", "bv": "|", "at": "@", "sh": "#",
    "Do": "$", "lh": "<=", "rh": "=>", "ua": "^", "da": "v", "ul": "_", "ru": "_", "pc": ".", "ci": "o",
    "sq": "#", "*a": "alpha", "*b": "beta", "*m": "mu", "*p": "pi", "~~": "~", "~=": "~=", "if": "inf",
    "tno": "~", "char46": ".", "char92": "\\", "char39": "'", "char45": "-",
}
DEFAULT_STRINGS: dict[str, str] = {"Aq": "'", "lq": '"', "rq": '"', "R": "(R)", "Tm": "(TM)", "aq": "'"}

_FONT_MACROS = {"B", "I", "BR", "RB", "BI", "IB", "IR", "RI", "SM", "SB", "CW"}
_BREAKS = {"PP", "LP", "P", "sp", "HP", "ns"}


@dataclass
class _State:
    """Where the converter is: the output so far, the paragraph being filled, indentation and modes."""

    lines: list[str] = field(default_factory=list)
    words: list[str] = field(default_factory=list)
    indent: int = 0  # body indent of the current paragraph
    base: int = INDENT  # indent set by .RS nesting
    rs_stack: list[int] = field(default_factory=list)
    nofill: bool = False
    tag_pending: bool = False  # the next text line is a .TP tag
    section: str = ""
    keep: bool = True
    strings: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_STRINGS))
    list_stack: list[tuple[str, int, int]] = field(default_factory=list)  # mdoc .Bl: (kind, outer base, items)
    mdoc_name: str = ""  # the first .Nm argument, repeated by a bare .Nm

    def flush(self) -> None:
        if self.words and self.keep:
            text = " ".join(self.words)
            wrapped = textwrap.wrap(text, width=max(WIDTH - self.indent, 30), break_long_words=False,
                                    break_on_hyphens=False)
            self.lines.extend(" " * self.indent + line for line in wrapped)
        self.words = []

    def blank(self) -> None:
        self.flush()
        if self.keep and self.lines and self.lines[-1] != "":
            self.lines.append("")

    def emit(self, text: str, indent: int | None = None) -> None:
        if self.keep:
            self.lines.append(" " * (self.indent if indent is None else indent) + text)


def _delimited(text: str, start: int) -> int:
    """End index (after the closing delimiter) of an escape argument like 'abc' that starts at `start`."""
    delim = text[start] if start < len(text) else ""
    if not delim:
        return start
    end = text.find(delim, start + 1)
    return len(text) if end < 0 else end + 1


def _name_at(text: str, start: int) -> tuple[str, int]:
    """A groff name after an escape: `(xx`, `[long name]`, or a single character."""
    if start >= len(text):
        return "", start
    if text[start] == "(":
        return text[start + 1 : start + 3], start + 3
    if text[start] == "[":
        end = text.find("]", start)
        end = len(text) if end < 0 else end
        return text[start + 1 : end], end + 1
    return text[start], start + 1


def expand_escapes(text: str, strings: dict[str, str] | None = None) -> str:
    """Replace groff escapes in one line of text with plain characters (fonts, motions and sizes vanish)."""
    strings = DEFAULT_STRINGS if strings is None else strings
    out: list[str] = []
    i = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if ch != "\\" or i + 1 >= n:
            out.append(ch)
            i += 1
            continue
        esc = text[i + 1]
        i += 2
        if esc in "-":
            out.append("-")
        elif esc in "e\\":
            out.append("\\")
        elif esc in "&|^%:c)dupatrz{},/":  # zero-width, hyphenation, italic corrections, \c, \{ \} braces
            pass
        elif esc in " ~0":
            out.append(" ")
        elif esc == "'":
            out.append("'")
        elif esc == "`":
            out.append("`")
        elif esc == ".":
            out.append(".")
        elif esc == '"':  # comment to end of line
            break
        elif esc == "f" or esc == "F" or esc == "n" or esc == "g" or esc == "k" or esc == "m" or esc == "M":
            _, i = _name_at(text, i + 1 if esc == "n" and i < n and text[i] in "+-" else i)
        elif esc == "*":
            name, i = _name_at(text, i)
            out.append(strings.get(name, ""))
        elif esc == "(":
            name, i = text[i : i + 2], i + 2
            out.append(GLYPHS.get(name, ""))
        elif esc == "[":
            end = text.find("]", i)
            end = n if end < 0 else end
            name, i = text[i:end], end + 1
            if name.startswith("u") and re.fullmatch(r"u[0-9A-Fa-f]{4,6}", name):
                out.append(chr(int(name[1:], 16)))
            else:
                out.append(GLYPHS.get(name, ""))
        elif esc == "s":  # \s+2, \s-1, \s0, \s[12], \s'12'
            if i < n and text[i] in "+-":
                i += 1
            if i < n and text[i] in "[(":
                _, i = _name_at(text, i)
            elif i < n and text[i] == "'":
                i = _delimited(text, i)
            else:
                while i < n and text[i].isdigit():
                    i += 1
        elif esc in "hvwlLDoXZbHSxRAN":
            end = _delimited(text, i)
            if esc == "N":
                number = text[i + 1 : end - 1]
                out.append(chr(int(number)) if number.isdigit() else "")
            elif esc == "o":  # overstrike: keep the last glyph
                out.append(text[i + 1 : end - 1][-1:])
            i = end
        else:
            out.append(esc)
    return "".join(out)


def _split_args(line: str) -> list[str]:
    """Macro arguments: space separated, double quotes group, `""` inside quotes is a literal quote."""
    args: list[str] = []
    i, n = 0, len(line)
    while i < n:
        while i < n and line[i] in " \t":
            i += 1
        if i >= n:
            break
        if line[i] == '"':
            i += 1
            buf = []
            while i < n:
                if line[i] == '"':
                    if i + 1 < n and line[i + 1] == '"':
                        buf.append('"')
                        i += 2
                        continue
                    i += 1
                    break
                buf.append(line[i])
                i += 1
            args.append("".join(buf))
        else:
            start = i
            while i < n and line[i] not in " \t":
                if line[i] == "\\" and i + 1 < n:
                    i += 1
                i += 1
            args.append(line[start:i])
    return args


def _skip_block(lines: list[str], i: int) -> int:
    """Index after a `\\{ ... \\}` block that starts on line i (nesting counted)."""
    depth = 0
    while i < len(lines):
        depth += lines[i].count("\\{") - lines[i].count("\\}")
        i += 1
        if depth <= 0:
            break
    return i


def _condition_true(cond: str) -> bool:
    """Conditions of `.if`/`.ie`: we are nroff (`n` true, `t` false); anything else is treated as false."""
    negate = cond.startswith("!")
    cond = cond[1:] if negate else cond
    value = cond == "n"
    return value != negate


def _table(lines: list[str], i: int, state: _State) -> int:
    """Render a tbl(1) table (.TS ... .TE) as rows of cells separated by two spaces; returns the index after it."""
    i += 1
    sep = "\t"
    # Options line (ends with ';', may set the cell separator with tab(X)) and format lines (the last ends with '.').
    if i < len(lines) and lines[i].rstrip().endswith(";"):
        match = re.search(r"tab\s*\((.)\)", lines[i])
        sep = match.group(1) if match else sep
        i += 1
    while i < len(lines) and not lines[i].rstrip().endswith(".") and lines[i].strip() != ".TE":
        i += 1
    i += 1
    state.blank()
    row: list[str] = []
    block: list[str] | None = None

    def cells(text: str) -> None:
        nonlocal block
        for cell in text.split(sep):
            if cell.endswith("T{"):
                row.append(expand_escapes(cell[:-2], state.strings).strip())
                block = []
            else:
                row.append(expand_escapes(cell, state.strings).strip())

    def end_row() -> None:
        state.emit("  ".join(c for c in row if c))
        row.clear()

    while i < len(lines) and not lines[i].startswith(".TE"):
        line = lines[i]
        i += 1
        if block is not None:
            if line.startswith("T}"):
                row.append(" ".join(block))
                block = None
                rest = line[2:]
                if rest.startswith(sep):
                    cells(rest[len(sep) :])
                if block is None:
                    end_row()
            elif not line.startswith((".", "'")):
                block.append(expand_escapes(line, state.strings).strip())
            continue
        if line.startswith((".", "'")) or line.strip() in ("_", "=", ""):
            continue
        cells(line)
        if block is None:
            end_row()
    state.blank()
    return i + 1


# mdoc(7): macros that format their arguments inline, and how.
_MDOC_ENCLOSE: dict[str, tuple[str, str]] = {
    "Op": ("[", "]"), "Dq": ('"', '"'), "Qq": ('"', '"'), "Sq": ("'", "'"), "Ql": ("'", "'"), "Pq": ("(", ")"),
    "Aq": ("<", ">"), "Bq": ("[", "]"), "Brq": ("{", "}"),
}
_MDOC_OPEN_CLOSE = {"Oo": "[", "Oc": "]", "Do": '"', "Dc": '"', "Po": "(", "Pc": ")", "Qo": '"', "Qc": '"',
                    "So": "'", "Sc": "'", "Bro": "{", "Brc": "}", "Ao": "<", "Ac": ">", "Bo": "[", "Bc": "]"}
_MDOC_PLAIN = {"Ar", "Cm", "Ic", "Ev", "Pa", "Va", "Dv", "Er", "Li", "Em", "Sy", "No", "Tn", "Sx", "Lk", "Mt", "Ad",
               "Fn", "Fa", "Ft", "Cd", "Ms", "Vt", "Xo", "Xc", "St", "Bsx", "Bx", "Fx", "Nx", "Ox", "At", "Ta",
               "An", "Ek", "Bk", "Sm", "Dx", "Lb", "In", "Fd", "Ot", "Es", "En", "Eo", "Ec", "Pf"}
_MDOC_INLINE = set(_MDOC_ENCLOSE) | set(_MDOC_OPEN_CLOSE) | _MDOC_PLAIN | {"Fl", "Xr", "Nm", "Ns", "Ux"}
_CLOSING_PUNCT = {".", ",", ";", ":", "?", "!", ")", "]", "}"}
_NO_SPACE = "\x00"  # marks where .Ns removes the space


def _mdoc_inline(tokens: list[str], state: _State) -> str:
    """Render a line of mdoc tokens: macro names among them are called, other tokens are words."""
    out: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token in _MDOC_ENCLOSE:
            opener, closer = _MDOC_ENCLOSE[token]
            trailing: list[str] = []
            rest = tokens[i:]
            while rest and rest[-1] in _CLOSING_PUNCT:  # punctuation at the end stays outside the brackets
                trailing.insert(0, rest.pop())
            out.append(opener + _mdoc_inline(rest, state) + closer + "".join(trailing))
            break
        if token in _MDOC_OPEN_CLOSE:
            out.append(_MDOC_OPEN_CLOSE[token])
            if token.endswith("o"):
                out.append(_NO_SPACE)
            else:
                out.insert(len(out) - 1, _NO_SPACE)
            continue
        if token == "Fl":
            if i < len(tokens) and tokens[i] not in _MDOC_INLINE and tokens[i] not in _CLOSING_PUNCT:
                out.append("-" + expand_escapes(tokens[i], state.strings))
                i += 1
            else:
                out.append("-")
            continue
        if token == "Xr":
            if i + 1 < len(tokens):
                out.append(f"{expand_escapes(tokens[i], state.strings)}({tokens[i + 1]})")
                i += 2
            continue
        if token == "Nm":
            if i < len(tokens) and tokens[i] not in _MDOC_INLINE and tokens[i] not in _CLOSING_PUNCT:
                if not state.mdoc_name:
                    state.mdoc_name = expand_escapes(tokens[i], state.strings)
                out.append(expand_escapes(tokens[i], state.strings))
                i += 1
            else:
                out.append(state.mdoc_name)
            continue
        if token == "Ns":
            out.append(_NO_SPACE)
            continue
        if token == "Ux":
            out.append("UNIX")
            continue
        if token in _MDOC_PLAIN:
            continue
        out.append(expand_escapes(token, state.strings))
    text = ""
    for piece in out:
        if piece == _NO_SPACE:
            text += _NO_SPACE
        elif not text or text.endswith((_NO_SPACE, "(", "[")) or piece in _CLOSING_PUNCT:
            text += piece
        else:
            text += " " + piece
    return text.replace(_NO_SPACE, "")


def _heading(state: _State, title: str, level: str, keep: Callable[[str], bool]) -> None:
    """Start a section (level "SH") or subsection ("SS"); a section outside the filter is dropped whole."""
    state.flush()
    state.rs_stack.clear()
    state.list_stack.clear()
    state.base = state.indent = INDENT
    state.nofill = state.tag_pending = False
    if level == "SH":
        state.section = title.upper()
        state.keep = keep(state.section)
        state.blank()
        state.emit(title.upper(), 0)
    else:
        state.blank()
        state.emit(title, INDENT // 2)


def _mdoc_request(name: str, args: list[str], state: _State, keep: Callable[[str], bool]) -> bool:
    """Handle one mdoc block macro; returns False when `name` is not one (the man(7) path then tries it)."""
    if name in ("Sh", "Ss"):
        _heading(state, _mdoc_inline(args, state), "SH" if name == "Sh" else "SS", keep)
    elif name in ("Pp", "Lp"):
        state.blank()  # inside a list item the paragraph keeps the item's indent
        state.indent = state.indent if state.list_stack else state.base
    elif name == "Nd":
        state.words.extend(["-", _mdoc_inline(args, state)])
    elif name == "Bl":
        state.flush()
        kind = next((a for a in args if a in ("-tag", "-hang", "-ohang", "-inset", "-bullet", "-dash", "-hyphen",
                                              "-enum", "-item", "-column", "-diag")), "-tag")
        state.list_stack.append((kind, state.base, 0))
        state.base = state.indent if state.indent > state.base else state.base
        state.indent = state.base
    elif name == "El":
        state.flush()
        if state.list_stack:
            _, state.base, _ = state.list_stack.pop()
        state.indent = state.base
    elif name == "It":
        kind, outer, count = state.list_stack[-1] if state.list_stack else ("-tag", state.base, 0)
        if state.list_stack:
            state.list_stack[-1] = (kind, outer, count + 1)
        state.blank() if kind != "-column" else state.flush()
        if kind == "-column":
            cells = " ".join(args).split(" Ta ")
            state.emit("  ".join(_mdoc_inline(_split_args(c), state) for c in cells), state.base)
            return True
        marker = {"-bullet": "*", "-dash": "-", "-hyphen": "-", "-enum": f"{count + 1}."}.get(kind)
        tag = marker if marker else _mdoc_inline(args, state)
        if tag:
            state.emit(tag, state.base)
        state.indent = state.base + INDENT
    elif name == "Bd":
        state.flush()
        state.rs_stack.append(state.indent)
        state.nofill = any(a in ("-literal", "-unfilled") for a in args)
        if "-offset" in args:
            state.indent += INDENT
    elif name == "Ed":
        state.flush()
        state.nofill = False
        state.indent = state.rs_stack.pop() if state.rs_stack else state.base
    elif name in ("D1", "Dl"):
        state.flush()
        state.emit(_mdoc_inline(args, state), state.indent + INDENT)
    elif name == "Ex":
        state.words.extend(f"The {state.mdoc_name} utility exits 0 on success, and >0 if an error occurs.".split())
    elif name in ("Dd", "Dt", "Os", "Rs", "Re", "Bf", "Ef", "Bk", "Ek", "Sm") or name.startswith("%"):
        pass
    elif name in _MDOC_INLINE:
        if name == "Nm" and state.section == "SYNOPSIS":
            state.flush()
        text = _mdoc_inline([name, *args], state)
        _text_line(state, text)
    else:
        return False
    return True


def man_to_text(source: str, keep: Callable[[str], bool] = usage_sections) -> str:
    """Plain text of a man(7) or mdoc(7) page, with only the sections whose upper-cased title `keep` accepts."""
    state = _State()
    lines = source.replace("\r\n", "\n").split("\n")
    mdoc = any(line.startswith((".Sh ", ".Dd")) for line in lines)
    i = 0
    el_branch = True  # whether a following .el should be taken
    while i < len(lines):
        raw = lines[i]
        i += 1
        if raw.startswith((".\\\"", "'\\\"", "\\\"")) or raw.strip() in (".", "'"):
            continue
        if raw.startswith((".", "'")) and len(raw) > 1:
            request = raw[1:].lstrip()
            name, _, rest = request.partition(" ")
            name = name.strip()
            rest = rest.strip()
            if mdoc and _mdoc_request(name, _split_args(rest), state, keep):
                continue
            if name in ("ie", "if", "el"):
                if name == "el":
                    taken, body = el_branch, rest
                else:
                    cond, _, body = rest.partition(" ")
                    taken = _condition_true(cond)
                    if name == "ie":
                        el_branch = not taken
                body = body.strip()
                if body.startswith("\\{"):
                    if not taken:
                        i = _skip_block(lines, i - 1)
                    else:
                        inner = body[2:].strip().rstrip("\\").strip()
                        if inner:
                            lines.insert(i, inner)
                elif taken and body:
                    lines.insert(i, body)
                continue
            if name.startswith("\\}"):
                continue
            if name in ("de", "ig", "am"):
                while i < len(lines) and not lines[i].startswith(".."):
                    i += 1
                i += 1
                continue
            if name == "ds":
                key, _, value = rest.partition(" ")
                state.strings[key] = expand_escapes(value.lstrip('"'), state.strings)
                continue
            if name == "TS":
                i = _table(lines, i - 1, state)
                continue
            if name in ("SH", "SS"):
                title = expand_escapes(" ".join(_split_args(rest)), state.strings).strip()
                if not title and i < len(lines):  # heading on the next line
                    title = expand_escapes(lines[i], state.strings).strip()
                    i += 1
                _heading(state, title, name, keep)
                continue
            if name in _BREAKS:
                state.blank()
                state.indent = state.base
                continue
            if name in ("br", "ti"):
                state.flush()
                continue
            if name in ("TP", "TQ"):
                state.blank() if name == "TP" else state.flush()
                state.tag_pending = True
                state.indent = state.base
                continue
            if name == "IP":
                state.blank()
                args = _split_args(rest)
                tag = expand_escapes(args[0], state.strings).strip() if args else ""
                if tag:
                    state.emit(tag, state.base)
                state.indent = state.base + INDENT
                continue
            if name == "RS":
                state.flush()
                state.rs_stack.append(state.base)
                state.base = state.indent if state.indent > state.base else state.base + INDENT
                state.indent = state.base
                continue
            if name == "RE":
                state.flush()
                state.base = state.rs_stack.pop() if state.rs_stack else INDENT
                state.indent = state.base
                continue
            if name in ("nf", "EX"):
                state.flush()
                state.nofill = True
                continue
            if name in ("fi", "EE"):
                state.flush()
                state.nofill = False
                continue
            if name in _FONT_MACROS:
                args = _split_args(rest)
                if args:  # without arguments the font applies to the next text line, which we print as is
                    joiner = " " if name in ("B", "I", "SM", "SB", "CW") else ""
                    _text_line(state, joiner.join(expand_escapes(a, state.strings) for a in args))
                continue
            if name == "SY":
                state.flush()
                state.words = [expand_escapes(rest, state.strings)]
                continue
            if name == "OP":
                args = [expand_escapes(a, state.strings) for a in _split_args(rest)]
                state.words.append("[" + " ".join(args) + "]")
                continue
            if name == "YS":
                state.blank()
                continue
            if name in ("UE", "ME"):
                tail = expand_escapes(rest, state.strings)
                if tail and state.words:
                    state.words[-1] += tail
                continue
            # Everything else (.TH, .UR, .nh, .ad, .ft, .in, .ne, .PD, .ll, .tr, .hy, ...) has no text to keep.
            continue
        if raw.rstrip().endswith("\\c") and i < len(lines) and not lines[i].startswith((".", "'")):
            lines[i] = raw.rstrip()[:-2] + lines[i]
            continue
        _text_line(state, expand_escapes(raw, state.strings))
    state.flush()
    out = "\n".join(state.lines).strip("\n")
    out = re.sub(r"(?m)^(\S.*)\n\n(?=[ \t]*\S)", r"\1\n", out)  # no blank line under a section heading
    return re.sub(r"\n{3,}", "\n\n", out)


def _text_line(state: _State, text: str) -> None:
    """One line of text: a .TP tag, a verbatim line (no-fill mode), or words to fill into the paragraph."""
    if state.tag_pending:
        state.tag_pending = False
        state.flush()
        state.emit(text.strip(), state.base)
        state.indent = state.base + INDENT
        return
    if state.nofill:
        state.emit(text.rstrip())
        return
    if not text.strip():
        state.blank()
        return
    state.words.extend(text.split())
