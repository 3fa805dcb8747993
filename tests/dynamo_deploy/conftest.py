"""Fixtures the Dynamo deployment tests share: the in-process reference, and the deployments that several modules
use. A deployment costs a worker start per process and the frontend (about 20 s on two cores), so each configuration
starts once for the package, on first use, and stops when the package's tests are done:

- `dynamo_1x1`: one encoder and one decoder worker, default options (the choices, completions, sampling-options,
  session-auth, tools, source-independence and DSpark-worker tests);
- `dynamo_fleet`: three encoders and two decoders (the routing tests of test_deployment, then the kills of
  test_deployment and test_faults, each of which leaves one worker fewer: see there).

Tests that share one use their own session ids and read counters as before/after differences. A test that needs
other worker options starts its own with `deploy`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from ced.ports import free_port
from dynamo_deploy.launcher import DYNAMO_PYTHON, Deployment
from tests.conftest import EMBEDDED
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.core.pipeline import InProcessPipeline


def deploy(run_dir: Path, engines: Path, encoders: int = 1, decoders: int = 1, **options: Any) -> Deployment:
    """A started deployment on a free loopback port (`options`: the launcher's worker options); on a failed start
    whatever did start is stopped, so no process outlives the test that asked."""
    if not DYNAMO_PYTHON.exists():
        pytest.fail(f"{DYNAMO_PYTHON} missing: run `bash scripts/setup_dynamo.sh` (scripts/setup.sh does)")
    d = Deployment(run_dir, EMBEDDED, engines, encoders=encoders, decoders=decoders, http_port=free_port(), **options)
    try:
        d.start(timeout_s=300)
    except BaseException:
        d.stop()
        raise
    return d


@pytest.fixture(scope="module")
def reference(tmp_path_factory, default_engines) -> InProcessPipeline:  # type: ignore[no-untyped-def]
    """The serving library in process on the same engines: what every deployment's turns must equal."""
    root = tmp_path_factory.mktemp("reference_registry")
    ensure_registry(root, EMBEDDED)
    return InProcessPipeline(EMBEDDED, root, max_context=2048, backend="onnx", engine_dir=default_engines)


@pytest.fixture(scope="package")
def dynamo_1x1(tmp_path_factory, default_engines) -> Iterator[Deployment]:  # type: ignore[no-untyped-def]
    """One encoder and one decoder worker, default options (DSpark drafting on). test_source_independence compares
    log-probabilities on it: its turns ask for them, which keeps those turns undrafted, as the workers'
    `--record-logprobs` would keep every turn."""
    d = deploy(tmp_path_factory.mktemp("dynamo-1x1"), default_engines)
    try:
        yield d
    finally:
        d.stop()


FLEET_ENCODERS, FLEET_DECODERS = 3, 2


@pytest.fixture(scope="package")
def dynamo_fleet(tmp_path_factory, default_engines) -> Iterator[Deployment]:  # type: ignore[no-untyped-def]
    """Three encoders and two decoders, default options. The routing tests run first, on all of them (two decoders:
    the concurrent-sessions test holds that both take sessions); then three kill tests in file order, each needing two
    live workers of the role it kills: the encoder killed between turns (3 -> 2 encoders), a decoder killed
    mid-stream (2 -> 1 decoders), an encoder killed mid-stream (2 -> 1 encoders). The test after a kill needs no wait:
    the encoder kill's own test waits until the frontend drops the dead encoder (its discovery lease), and a dead
    decoder is dropped by each encoder at its first failed call, whose turn goes to a live decoder
    (encoder_worker.py)."""
    d = deploy(tmp_path_factory.mktemp("dynamo-fleet"), default_engines, encoders=FLEET_ENCODERS,
               decoders=FLEET_DECODERS)
    try:
        yield d
    finally:
        d.stop()
