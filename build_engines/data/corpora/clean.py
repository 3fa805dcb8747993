"""Text cleaning shared by every source: one canonical form, boilerplate out, sizes kept in a useful range.

Why canonical form matters: the manifest hashes the outputs, and a tokenizer trained later should not learn
`\\r\\n` from one archive and `\\n` from another. Why cap document size: a 300 KB man page or a whole novel as one
JSONL line is awkward for every consumer; parts keep their document's group, so they always land in the same split.
"""

from __future__ import annotations

import re
import unicodedata

# Control characters other than tab and newline (form feeds in old texts, NULs in odd files).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_MANY_BLANK_LINES = re.compile(r"\n{4,}")

_GUTENBERG_START = re.compile(
    r"^.*(\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG|\*END\*THE SMALL PRINT!).*$", re.I | re.M)
_GUTENBERG_END = re.compile(
    r"^.*(\*\*\*\s*END OF (THIS|THE) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$", re.I | re.M)


def normalize_text(text: str) -> str:
    """NFC, `\\n` line ends, no control characters or trailing spaces, at most two blank lines in a row."""
    text = unicodedata.normalize("NFC", text.replace("\ufeff", ""))
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return _MANY_BLANK_LINES.sub("\n\n\n", text).strip("\n")


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg header (up to its START marker) and licence footer (from its END marker)."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text


def drop_paragraphs(text: str, pattern: re.Pattern[str]) -> str:
    """Remove blank-line separated paragraphs that match `pattern` (e.g. transcriber notes naming Gutenberg)."""
    paragraphs = re.split(r"\n[ \t]*\n", text)
    return "\n\n".join(p for p in paragraphs if not pattern.search(p))


def content_chars(text: str) -> int:
    """Characters that are not whitespace: what "near-empty" is measured in."""
    return sum(1 for ch in text if not ch.isspace())


def split_long(text: str, max_chars: int) -> list[str]:
    """Split `text` into parts of at most `max_chars`, cutting at blank lines, else at line ends, else anywhere.

    Parts are packed greedily in order; only the newlines at the cuts are dropped, no other character is lost.
    """
    if max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}")
    parts: list[str] = []
    rest = text
    while len(rest) > max_chars:
        window = rest[: max_chars + 1]
        cut = window.rfind("\n\n")
        if cut <= 0:
            cut = window.rfind("\n")
        if cut <= 0:
            cut = max_chars
        parts.append(rest[:cut].strip("\n"))
        rest = rest[cut:].lstrip("\n")
    if rest.strip():
        parts.append(rest)
    return [part for part in parts if part.strip()]
