"""Errors of the data step, each carrying a one-line message meant for the person running the command.

Why a hierarchy: the CLI prints any `CorporaError` as one line and exits non-zero, while unexpected exceptions keep
their traceback; callers of the reader can catch `DataNotPrepared` to tell "not built yet" from real bugs.
"""

from __future__ import annotations


class CorporaError(Exception):
    """Base class: a failure the user can act on, described in one line."""


class DownloadError(CorporaError):
    """A registry download failed, or delivered a file other than the pinned one."""


class ExtractError(CorporaError):
    """An archive did not contain what a source expects (a pinned package changed shape, or the cache is corrupt)."""


class DataNotPrepared(CorporaError, FileNotFoundError):
    """The data directory, a source or a labelled set has not been prepared (yet)."""
