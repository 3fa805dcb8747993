"""One helper for the benchmark scripts that share a doc: replace (or append) a script's own `## ...` section."""

from __future__ import annotations

from pathlib import Path


def write_section(path: Path, section: str, heading: str, title: str = "# Serving under load") -> None:
    """`section` starts with `heading`; everything else in the file is kept."""
    text = path.read_text() if path.exists() else f"{title}\n\n"
    if heading in text:
        start = text.index(heading)
        rest = text[start + len(heading):]
        end = rest.find("\n## ")
        text = text[:start] + section.rstrip() + "\n" + (rest[end:] if end >= 0 else "")
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text)
