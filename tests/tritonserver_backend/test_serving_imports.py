"""Serving needs the core library, not the build pipeline: the Python-backend model processes of a real tritonserver
serve routed turns without importing one module of `build_engines` (issue 48).

Read from the model processes themselves: the test renders the repository, then appends to each model's `model.py` a
`finalize` that writes the process's `sys.modules` to a file before the model's own finalize runs. It checks that every
model of the pipeline did write its list (the check cannot pass by silence), that the services are in them, and that
none names `build_engines`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import EMBEDDED
from tritonserver_backend.clients.client import GrpcChat, TurnRequest
from tritonserver_backend.launcher import TritonServer
from tritonserver_backend.repository import build_repository

pytestmark = pytest.mark.slow

MODELS = ("preprocess", "encoder", "router", "decoder", "adapter_admin", "session_control")
RECORDER = """

def _record_modules(model):  # appended by tests/tritonserver_backend/test_serving_imports.py
    import json as _json
    import sys as _sys

    original = getattr(model, "finalize", None)

    def finalize(self):
        with open({out!r}, "w") as fh:
            _json.dump(sorted(_sys.modules), fh)
        if original is not None:
            original(self)

    model.finalize = finalize


_record_modules(TritonPythonModel)
"""


def test_model_processes_serve_without_the_build_pipeline(tmp_path: Path, default_engines: Path) -> None:
    values = {"model_dir": str(EMBEDDED), "registry_root": str(tmp_path / "registry"),
              "engine_dir": str(default_engines), "max_context": "2048"}
    repo = build_repository(tmp_path / "repo", values)
    for model in MODELS:
        code = repo / model / "1" / "model.py"
        code.write_text(code.read_text() + RECORDER.format(out=str(tmp_path / f"{model}.modules.json")))
    server = TritonServer(work_dir=tmp_path / "server")
    server.start(repo)
    try:
        server.wait_ready(240)
        chat = GrpcChat(server.grpc_url)
        try:
            first = chat.turn(TurnRequest("imports", "import os\nprint(os.listdir('.'))", new_session=True,
                                          max_tokens=8))
            second = chat.turn(TurnRequest("imports", "thanks!", adapter="L0_chat", max_tokens=8))
        finally:
            chat.close()
        assert not first.error and not second.error, (first.error, second.error)
        assert first.token_ids and second.token_ids
    finally:
        server.stop()
    loaded = {m: json.loads((tmp_path / f"{m}.modules.json").read_text()) for m in MODELS}
    assert "tritonserver_backend.core.encoder_service" in loaded["encoder"]
    assert "tritonserver_backend.core.decoder_service" in loaded["decoder"]
    assert "ced.steps.rows" in loaded["decoder"]
    build = {m: [n for n in names if n.split(".")[0] == "build_engines"] for m, names in loaded.items()}
    assert not any(build.values()), f"model processes imported the build pipeline: {build}"
