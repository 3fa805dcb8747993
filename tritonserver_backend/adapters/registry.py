"""The adapter registry shared by the router, decoder and admin models: one JSON file, atomic writes.

Each model process keeps its own view and refreshes it when the file changes, so loading, updating (a new version
of the same path) and unloading an adapter reach every model without a restart. An adapter's identity is the
31-bit FNV-1a hash of its registered path, the value that travels as ADAPTER_HASH.
"""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ced.lora import adapter_hash
from tritonserver_backend.errors import BadRequest, UnknownAdapter

REGISTRY_FILE = "registry.json"
BASE_NAME = "base"


@dataclass(frozen=True)
class Entry:
    name: str
    path: str  # as registered (relative paths are relative to the registry's root)
    description: str

    @property
    def hash(self) -> int:
        return adapter_hash(self.path)


class Registry:
    """Read/refresh/write the registry file at `root/registry.json`."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.file = self.root / REGISTRY_FILE
        self._stamp: tuple[int, int] | None = None
        self._entries: dict[str, Entry] = {}
        self.refresh()

    def resolve_path(self, entry: Entry) -> Path:
        p = Path(entry.path)
        return p if p.is_absolute() else self.root / p

    def refresh(self) -> bool:
        """Re-read the file if it changed since the last read; returns whether it did."""
        try:
            st = self.file.stat()
        except FileNotFoundError:
            changed = bool(self._entries) or self._stamp is not None
            self._entries, self._stamp = {}, None
            return changed
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return False
        data = json.loads(self.file.read_text())
        self._entries = {name: Entry(name, e["path"], e.get("description", ""))
                         for name, e in data.get("adapters", {}).items()}
        self._stamp = stamp
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Entry]:
        return [self._entries[k] for k in sorted(self._entries)]

    def by_name(self, name: str) -> Entry:
        if name not in self._entries:
            raise UnknownAdapter(f"unknown adapter {name!r}; loaded adapters: {sorted(self._entries)} (or "
                                 f"{BASE_NAME!r})")
        return self._entries[name]

    def check_explicit(self, adapter: str | None) -> None:
        """An explicit adapter must exist before the turn is encoded (errors lose nothing); empty or "base" passes."""
        if adapter and adapter != BASE_NAME:
            self.refresh()
            self.by_name(adapter)

    def by_hash(self, value: int) -> Entry | None:
        """None for 0 (base); UnknownAdapter for a hash no loaded adapter has (e.g. unloaded meanwhile)."""
        if value == 0:
            return None
        for e in self._entries.values():
            if e.hash == value:
                return e
        raise UnknownAdapter(f"adapter hash {value} is not loaded (unloaded meanwhile?); loaded adapters: "
                             f"{sorted(self._entries)}")

    def name_of(self, value: int) -> str:
        try:
            entry = self.by_hash(value)
        except UnknownAdapter:
            return f"unknown:{value}"
        return BASE_NAME if entry is None else entry.name

    # ---------------------------------------------------------------- writes (admin)
    @contextmanager
    def _locked(self) -> Iterator[dict]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".registry.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = json.loads(self.file.read_text()) if self.file.exists() else {"adapters": {}}
            yield data
            tmp = self.file.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, self.file)
        self.refresh()

    def put(self, name: str, path: str, description: str, max_entries: int | None = None) -> Entry:
        """Add or update `name`. `max_entries` bounds the number of adapters (checked under the lock, so two
        concurrent loads cannot both pass it); an update of a loaded name never counts against it."""
        self.put_all([(name, path, description)], max_entries)
        return self.by_name(name)

    def put_all(self, entries: list[tuple[str, str, str]], max_entries: int | None = None) -> None:
        """Add or update several (name, path, description) in one write of the file: a reader sees all or none."""
        for name, _, _ in entries:
            if not name or name == BASE_NAME or "/" in name or not name.isprintable():
                raise BadRequest(f"invalid adapter name {name!r}")
        with self._locked() as data:
            for name, path, description in entries:
                if max_entries is not None and name not in data["adapters"] and len(data["adapters"]) >= max_entries:
                    raise BadRequest(f"adapter {name!r} refused: {len(data['adapters'])} adapters are loaded and this "
                                     f"server holds at most {max_entries} (adapter_admin parameter max_adapters); "
                                     "unload one first")
                for other, e in data["adapters"].items():
                    if other != name and adapter_hash(e["path"]) == adapter_hash(path):
                        raise BadRequest(f"path {path!r} is already registered as {other!r}")
                data["adapters"][name] = {"path": path, "description": description}

    def remove(self, name: str) -> Entry:
        entry = self.by_name(name)
        with self._locked() as data:
            data["adapters"].pop(name, None)
        return entry
