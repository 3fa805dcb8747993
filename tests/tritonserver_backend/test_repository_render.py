"""`python -m tritonserver_backend.repository`: a repository rendered elsewhere starts as rendered, the committed one
is rewritten only on request, and a model that cannot start fails the launch at once with its reason."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tritonserver_backend import contract as c
from tritonserver_backend.repository import SOURCE_REPOSITORY, main


def test_the_committed_repository_is_rewritten_only_with_force(capsys) -> None:  # type: ignore[no-untyped-def]
    before = {p: p.read_text() for p in SOURCE_REPOSITORY.glob("*/config.pbtxt")}
    with pytest.raises(SystemExit) as exited:
        main(["--out", str(SOURCE_REPOSITORY), "--engine-backend", "torch"])
    assert exited.value.code == 2 and "--force" in capsys.readouterr().err
    assert {p: p.read_text() for p in SOURCE_REPOSITORY.glob("*/config.pbtxt")} == before
    with pytest.raises(SystemExit):
        main([])  # --out is required: no default that writes into the checkout


def test_a_repository_rendered_elsewhere_is_complete_with_absolute_paths(tmp_path: Path) -> None:
    out = tmp_path / "repo"
    assert main(["--out", str(out), "--engine-backend", "torch"]) == 0
    for model in c.MODELS:
        config = (out / model.name / "config.pbtxt").read_text()
        assert (out / model.name / "1" / "model.py").is_file(), model.name
        for line in config.splitlines():
            if "string_value" in line and any(k in config for k in ("model_dir", "engine_dir")):
                value = line.split('"')[1]
                if "/" in value:
                    assert Path(value).is_absolute(), (model.name, value)
    assert 'string_value: "torch"' in (out / "decoder" / "config.pbtxt").read_text()
    assert (out / c.ENSEMBLE_NAME / "config.pbtxt").is_file()


def _parameter(config: str, key: str) -> str:
    return config.split(f'key: "{key}"', 1)[1].split('"', 2)[1]


def test_tensor_parallel_renders_torch_roles_and_refuses_contradictions(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`--tensor-parallel-size 2 --enable-expert-parallel` reaches the encoder and decoder models (on the torch engine,
    the one that runs ranks); asking for onnx with it, or expert parallel on one rank, is refused with the reason."""
    out = tmp_path / "repo"
    assert main(["--out", str(out), "--tensor-parallel-size", "2", "--enable-expert-parallel"]) == 0
    for model in ("encoder", "decoder"):
        config = (out / model / "config.pbtxt").read_text()
        assert (_parameter(config, "engine_backend"), _parameter(config, "tensor_parallel_size"),
                _parameter(config, "enable_expert_parallel")) == ("torch", "2", "true"), model
    assert main(["--out", str(tmp_path / "plain")]) == 0
    assert _parameter((tmp_path / "plain" / "decoder" / "config.pbtxt").read_text(), "engine_backend") == "onnx"
    for argv, reason in ((["--tensor-parallel-size", "2", "--engine-backend", "onnx"], "runs on the torch engine"),
                         (["--enable-expert-parallel"], "needs --tensor-parallel-size 2 or more")):
        with pytest.raises(SystemExit):
            main(["--out", str(tmp_path / "refused"), *argv])
        assert reason in capsys.readouterr().err


@pytest.mark.slow
def test_rendered_elsewhere_it_serves_and_a_broken_model_fails_the_launch_at_once(  # type: ignore[no-untyped-def]
        tmp_path: Path, default_engines) -> None:
    from tritonserver_backend.clients.client import GrpcChat, TurnRequest
    from tritonserver_backend.launcher import TritonServer, TritonServerError

    out = tmp_path / "repo"
    main(["--out", str(out), "--registry-root", str(tmp_path / "registry"), "--engine-dir", str(default_engines),
          "--max-context", "2048"])
    server = TritonServer(work_dir=tmp_path / "server")
    server.start(out)
    try:
        server.wait_ready(240)
        chat = GrpcChat(server.grpc_url)
        try:
            reply = chat.turn(TurnRequest("rendered", "Hi there!", new_session=True, max_tokens=4))
        finally:
            chat.close()
        assert reply.error is None and len(reply.token_ids) > 0, reply
    finally:
        server.stop()

    (out / "decoder" / "1" / "model.py").unlink()
    broken = TritonServer(work_dir=tmp_path / "broken")
    broken.start(out)
    t0 = time.monotonic()
    try:
        with pytest.raises(TritonServerError, match=r"(?s)cannot start.*decoder/1/model.py"):
            broken.wait_ready(240)
        assert time.monotonic() - t0 < 60, "the launch failed only at its timeout"
    finally:
        broken.stop()
