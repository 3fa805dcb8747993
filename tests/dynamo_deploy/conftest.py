"""Fixtures the Dynamo deployment tests share."""

from __future__ import annotations

import pytest

from tests.conftest import EMBEDDED
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.core.pipeline import InProcessPipeline


@pytest.fixture(scope="module")
def reference(tmp_path_factory, default_engines) -> InProcessPipeline:  # type: ignore[no-untyped-def]
    """The serving library in process on the same engines: what every deployment's turns must equal."""
    root = tmp_path_factory.mktemp("reference_registry")
    ensure_registry(root, EMBEDDED)
    return InProcessPipeline(EMBEDDED, root, max_context=2048, backend="onnx", engine_dir=default_engines)
