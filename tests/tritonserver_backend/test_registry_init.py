"""First-start initialisation of the adapter registry, as every model of the repository runs it at the same moment."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
from pathlib import Path

import pytest

from tests.conftest import EMBEDDED
from tritonserver_backend.registry_init import ensure_registry


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def _initialise(root: str, start: mp.synchronize.Event, out: mp.Queue) -> None:  # type: ignore[name-defined]
    start.wait()
    try:
        registry = ensure_registry(root, EMBEDDED)
        out.put(("ok", sorted(e.name for e in registry.entries())))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put(("error", repr(exc)))


@pytest.mark.slow
def test_model_processes_starting_together_initialise_one_complete_registry(tmp_path: Path) -> None:
    """Seven processes create the same fresh registry at once, as the repository's model stubs do when a server starts:
    none fails, each sees every bundled adapter, and the copied adapters are whole. Before the init lock, two processes
    copying the same adapter folder made a model fail to load with FileExistsError (the server did not start), and a
    process could find the registry with only part of the bundled adapters in it."""
    bundled = sorted(p.name for p in (EMBEDDED / "adapters").iterdir() if (p / "adapter_config.json").exists())
    ctx = mp.get_context("spawn")
    for attempt in range(3):
        root = tmp_path / f"registry-{attempt}"
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_initialise, args=(str(root), start, out)) for _ in range(7)]
        for p in procs:
            p.start()
        start.set()
        results = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(60)
        assert all(kind == "ok" for kind, _ in results), results
        assert all(names == bundled for _, names in results), results
        for name in bundled:
            assert _digests(root / "adapters" / name) == _digests(EMBEDDED / "adapters" / name)
