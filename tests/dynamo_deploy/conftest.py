"""Fixtures the Dynamo deployment tests share: the in-process reference, and one 1x1 deployment of the default
options for every module that needs that configuration (a deployment costs a worker start per role and the frontend;
six modules used to start their own). Tests that share it use their own session ids and read counters as
before/after differences; a module that stops, kills or reconfigures workers starts its own."""

from __future__ import annotations

import pytest

from ced.ports import free_port
from dynamo_deploy.launcher import DYNAMO_PYTHON, Deployment
from tests.conftest import EMBEDDED
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.core.pipeline import InProcessPipeline


@pytest.fixture(scope="module")
def reference(tmp_path_factory, default_engines) -> InProcessPipeline:  # type: ignore[no-untyped-def]
    """The serving library in process on the same engines: what every deployment's turns must equal."""
    root = tmp_path_factory.mktemp("reference_registry")
    ensure_registry(root, EMBEDDED)
    return InProcessPipeline(EMBEDDED, root, max_context=2048, backend="onnx", engine_dir=default_engines)


@pytest.fixture(scope="package")
def dynamo_1x1(tmp_path_factory, default_engines):  # type: ignore[no-untyped-def]
    """One encoder and one decoder worker, default options: started on first use, stopped when the package's tests
    are done. (Recording log-probabilities, as test_source_independence needs, turns drafting off: that module keeps
    a deployment of its own.)"""
    if not DYNAMO_PYTHON.exists():
        pytest.fail(f"{DYNAMO_PYTHON} missing: run `bash scripts/setup_dynamo.sh` (scripts/test.sh does)")
    port = free_port()
    d = Deployment(tmp_path_factory.mktemp("dynamo-1x1"), EMBEDDED, default_engines, encoders=1, decoders=1,
                   http_port=port)
    try:
        d.start(timeout_s=300)
        yield d
    finally:
        d.stop()
