"""A small reader of R's serialization format, enough for the text data that Debian's r-cran-* packages ship.

Why our own: R packages keep their data either in a lazy-load database (`data/Rdata.rdb` + `Rdata.rdx`, which no
Python library reads) or in `.rda` files. Both hold R's XDR serialization stream, and the objects we need are
character vectors, factors and data frames, so a ~150-line subset of the format (R Internals, "Serialization
formats") covers them without adding `rdata` (and its pandas/xarray dependencies) to the project.

Values come back as plain Python: NULL -> None, character vector -> list[str | None], integer/logical vector ->
list[int | None], double vector -> list[float], list -> list, pairlist -> dict (tag -> value). Attributes of a
vector are attached by wrapping it in `RObject(value, attributes)` only where it has any.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

# SEXP type codes (R Internals, section 1.1) and the pseudo-types used only by the serializer.
NILSXP, SYMSXP, LISTSXP, CLOSXP, ENVSXP, PROMSXP, LANGSXP = 0, 1, 2, 3, 4, 5, 6
CHARSXP, LGLSXP, INTSXP, REALSXP, CPLXSXP, STRSXP, DOTSXP = 9, 10, 13, 14, 15, 16, 17
VECSXP, EXPRSXP, BCODESXP, EXTPTRSXP, WEAKREFSXP, RAWSXP, S4SXP = 19, 20, 21, 22, 23, 24, 25
REFSXP, NILVALUE_SXP, GLOBALENV_SXP, UNBOUNDVALUE_SXP, MISSINGARG_SXP, BASENAMESPACE_SXP = 255, 254, 253, 252, 251, 250
NAMESPACESXP, PACKAGESXP, PERSISTSXP, EMPTYENV_SXP, BASEENV_SXP = 249, 248, 247, 242, 241
ATTRLANGSXP, ATTRLISTSXP = 240, 239
ALTREP_SXP = 238

NA_INTEGER = -(2**31)
_ENVIRONMENT_MARKERS = {GLOBALENV_SXP, EMPTYENV_SXP, BASEENV_SXP, BASENAMESPACE_SXP, UNBOUNDVALUE_SXP, MISSINGARG_SXP}


class RFormatError(ValueError):
    """The bytes are not an R serialization stream this reader understands (the message names what was found)."""


@dataclass
class RObject:
    """An R value that carries attributes (names, class, levels, row.names, ...)."""

    value: Any
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass
class REnvironment:
    """An R environment; only kept so that references to it resolve, its contents are not needed here."""

    frame: Any = None


class _Unserializer:
    """Reads one XDR ('X\\n') serialization stream; the reference table mirrors R's so REFSXP indices resolve."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.refs: list[Any] = []

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return int(value)

    def _length(self) -> int:
        length = self._int()
        if length == -1:  # long vector: two more ints, upper then lower 32 bits
            upper, lower = self._int(), self._int()
            length = (upper << 32) + (lower & 0xFFFFFFFF)
        return length

    def _bytes(self, n: int) -> bytes:
        chunk = self.data[self.pos : self.pos + n]
        if len(chunk) != n:
            raise RFormatError(f"stream ends at byte {self.pos}, wanted {n} more")
        self.pos += n
        return chunk

    def header(self) -> None:
        fmt = self._bytes(2)
        if fmt != b"X\n":
            raise RFormatError(f"only the XDR binary format is supported, stream starts with {fmt!r}")
        version = self._int()
        self._int(), self._int()  # R version that wrote it, minimal R version to read it
        if version == 3:
            self._bytes(self._int())  # native encoding name
        elif version != 2:
            raise RFormatError(f"serialization version {version} is not supported (2 and 3 are)")

    def item(self) -> Any:
        flags = self._int()
        kind = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))

        if kind == NILVALUE_SXP:
            return None
        if kind in _ENVIRONMENT_MARKERS:
            return REnvironment()
        if kind == REFSXP:
            index = flags >> 8
            return self.refs[(index or self._int()) - 1]
        if kind == PERSISTSXP:
            self._persistent_names()
            persistent = REnvironment()
            self.refs.append(persistent)
            return persistent
        if kind == SYMSXP:
            name = self.item()  # a CHARSXP
            self.refs.append(name)
            return name
        if kind in (PACKAGESXP, NAMESPACESXP):
            self._persistent_names()
            namespace = REnvironment()
            self.refs.append(namespace)
            return namespace
        if kind == ENVSXP:
            env = REnvironment()
            self.refs.append(env)
            self._int()  # locked flag
            self.item()  # enclosing environment
            env.frame = self.item()
            self.item()  # hash table
            self.item()  # attributes
            return env
        if kind in (LISTSXP, LANGSXP, CLOSXP, PROMSXP, DOTSXP, ATTRLANGSXP, ATTRLISTSXP):
            return self._pairlist(kind, has_attr, has_tag)
        if kind == CHARSXP:
            length = self._int()
            return None if length == -1 else self._bytes(length).decode("utf-8", errors="replace")

        if kind in (LGLSXP, INTSXP):
            n = self._length()
            values = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
            value: Any = [None if v == NA_INTEGER else v for v in values]
        elif kind == REALSXP:
            n = self._length()
            value = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        elif kind == STRSXP:
            value = [self.item() for _ in range(self._length())]
        elif kind in (VECSXP, EXPRSXP):
            value = [self.item() for _ in range(self._length())]
        elif kind == RAWSXP:
            value = self._bytes(self._length())
        else:
            raise RFormatError(f"R object type {kind} is not supported by this reader (at byte {self.pos - 4})")
        if has_attr:
            return RObject(value, self._attributes(self.item()))
        return value

    def _persistent_names(self) -> list[str]:
        if self._int() != 0:
            raise RFormatError("malformed persistent-name vector")
        return [self.item() for _ in range(self._int())]

    def _pairlist(self, kind: int, has_attr: bool, has_tag: bool) -> Any:
        """Pairlists are read iteratively (R writes the CDR chain as nested items, which can be very long)."""
        entries: dict[str, Any] = {}
        position = 0
        while True:
            if has_attr:
                self.item()
            tag = self.item() if has_tag else None
            entries[tag if isinstance(tag, str) else str(position)] = self.item()
            position += 1
            flags = self._int()
            next_kind = flags & 0xFF
            if next_kind == NILVALUE_SXP or next_kind not in (LISTSXP, LANGSXP, ATTRLISTSXP, ATTRLANGSXP):
                if next_kind != NILVALUE_SXP:  # the CDR is some other object: read it as the last element
                    self.pos -= 4
                    entries[str(position)] = self.item()
                return entries
            has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))

    @staticmethod
    def _attributes(pairlist: Any) -> dict[str, Any]:
        return pairlist if isinstance(pairlist, dict) else {}


def unserialize(data: bytes) -> Any:
    """Decode one uncompressed R serialization stream (what `serialize(x, NULL)` writes in XDR form)."""
    reader = _Unserializer(data)
    reader.header()
    return reader.item()


def _decompress_lazyload_blob(blob: bytes) -> bytes:
    """One object of a lazy-load DB: 4-byte big-endian length, then zlib data, or a type byte for the others."""
    (expected,) = struct.unpack_from(">I", blob, 0)
    kind = blob[4:5]
    if kind == b"Z":  # xz-compressed objects: raw LZMA2 stream with the default filter (R's R_decompress3)
        out = lzma.decompress(blob[5:], format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2, "preset": 9}])
    elif kind == b"2":
        out = bz2.decompress(blob[5:])
    elif kind == b"0":
        out = blob[5:]
    else:
        out = zlib.decompress(blob[4:])
    if len(out) != expected:
        raise RFormatError(f"lazy-load object decompressed to {len(out)} bytes, header says {expected}")
    return out


def named_list(obj: Any) -> dict[str, Any]:
    """An R named list (VECSXP with a names attribute) as a dict."""
    if not isinstance(obj, RObject) or "names" not in obj.attributes:
        raise RFormatError("expected a named list")
    return dict(zip(obj.attributes["names"], obj.value))


def read_lazyload_db(rdx: bytes, rdb: bytes) -> dict[str, Any]:
    """All variables of a lazy-load database, given the bytes of `Rdata.rdx` (gzip) and `Rdata.rdb`.

    The index maps each variable name to (offset, length) of its compressed, serialized value inside the .rdb.
    """
    index = named_list(unserialize(gzip.decompress(rdx)))
    variables = named_list(index["variables"])
    values: dict[str, Any] = {}
    for name in sorted(variables):
        offset, length = variables[name]
        values[name] = unserialize(_decompress_lazyload_blob(rdb[offset : offset + length]))
    return values


def read_rda(data: bytes) -> dict[str, Any]:
    """The variables of an `.rda`/`.RData` file (gzip, bzip2, xz or uncompressed; 'RDX2'/'RDX3' header)."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    elif data[:3] == b"BZh":
        data = bz2.decompress(data)
    elif data[:6] == b"\xfd7zXZ\x00":
        data = lzma.decompress(data)
    if data[:5] not in (b"RDX2\n", b"RDX3\n"):
        raise RFormatError(f"not an R data file (starts with {data[:5]!r})")
    pairs = unserialize(data[5:])
    if not isinstance(pairs, dict):
        raise RFormatError("R data file does not hold a pairlist of variables")
    return pairs


def factor_labels(obj: Any) -> list[str | None]:
    """The labels of an R factor (integer codes, 1-based, with a levels attribute)."""
    if not isinstance(obj, RObject) or "levels" not in obj.attributes:
        raise RFormatError("expected a factor")
    levels = obj.attributes["levels"]
    return [None if code is None else levels[code - 1] for code in obj.value]
