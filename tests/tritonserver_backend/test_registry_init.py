"""First-start initialisation of the adapter registry, as every model of the repository runs it at the same moment."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
from pathlib import Path

import pytest

from tests.conftest import EMBEDDED
from tritonserver_backend.adapters.registry_init import ensure_registry


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _initialise(roots: list[str], start: mp.synchronize.Barrier, out: mp.Queue) -> None:  # type: ignore[name-defined]
    """One model process: for each fresh registry root in turn, wait until every process is ready, then create it."""
    for attempt, root in enumerate(roots):
        start.wait()
        try:
            registry = ensure_registry(root, EMBEDDED)
            out.put((attempt, "ok", sorted(e.name for e in registry.entries())))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out.put((attempt, "error", repr(exc)))


@pytest.mark.slow
def test_model_processes_starting_together_initialise_one_complete_registry(tmp_path: Path) -> None:
    """Seven processes create the same fresh registry at once, as the repository's model stubs do when a server starts:
    none fails, each sees every bundled adapter, and the copied adapters are whole. Before the init lock, two processes
    copying the same adapter folder made a model fail to load with FileExistsError (the server did not start), and a
    process could find the registry with only part of the bundled adapters in it."""
    bundled = sorted(p.name for p in (EMBEDDED / "adapters").iterdir() if (p / "adapter_config.json").exists())
    ctx = mp.get_context("spawn")
    roots = [tmp_path / f"registry-{attempt}" for attempt in range(3)]  # three races; each process is spawned once
    start, out = ctx.Barrier(7), ctx.Queue()
    procs = [ctx.Process(target=_initialise, args=([str(r) for r in roots], start, out)) for _ in range(7)]
    for p in procs:
        p.start()
    results = [out.get(timeout=180) for _ in range(len(procs) * len(roots))]
    for p in procs:
        p.join(60)
    for attempt, root in enumerate(roots):
        mine = [(kind, names) for a, kind, names in results if a == attempt]
        assert len(mine) == len(procs) and all(kind == "ok" for kind, _ in mine), mine
        assert all(names == bundled for _, names in mine), mine
        for name in bundled:
            assert _digests(root / "adapters" / name) == _digests(EMBEDDED / "adapters" / name)
