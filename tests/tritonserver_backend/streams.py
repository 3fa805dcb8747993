"""Helpers the real-server tests share: the in-process reference reply of a request, and conversations run on
concurrent gRPC streams (the batched path whose replies must equal the solo ones)."""

from __future__ import annotations

import threading
from pathlib import Path

from tests.conftest import EMBEDDED
from tritonserver_backend.clients.client import GrpcChat, TurnRequest
from tritonserver_backend.core.pipeline import InProcessPipeline
from tritonserver_backend.sampling.sampler import SamplingParams


def params_of(r: TurnRequest) -> SamplingParams:
    return SamplingParams(max_tokens=r.max_tokens or 64, temperature=r.temperature or 0.0, top_p=r.top_p or 1.0,
                          seed=r.seed or 0, stop=tuple(r.stop or ()))


def reference_reply(pipe: InProcessPipeline, r: TurnRequest):  # type: ignore[no-untyped-def]
    """What the same request gets from the serving library in process (same services, same engines)."""
    return pipe.chat(r.session_id, r.text, r.adapter, r.new_session, r.history, params_of(r), r.end_session)


def concurrent_token_ids(url: str, conversations: list[list[TurnRequest]],
                         timeout: float = 600) -> tuple[list[list[list[int]]], list[str]]:
    """Each conversation on its own gRPC stream, all at once -> (token ids per conversation per turn, errors)."""
    results: dict[int, list[list[int]]] = {}
    errors: list[str] = []

    def run(i: int) -> None:
        chat = GrpcChat(url)
        try:
            results[i] = []
            for r in conversations[i]:
                reply = chat.turn(r)
                if reply.error:
                    errors.append(reply.error)
                results[i].append(reply.token_ids)
        finally:
            chat.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(conversations))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return [results.get(i, []) for i in range(len(conversations))], errors


def start_server(work: Path, engines: Path, **params: str):  # type: ignore[no-untyped-def]
    """A tritonserver on the embedded default's ONNX engines in `work`, with these model-config parameters, ready;
    its `registry_root` is where its admin key lives."""
    from tritonserver_backend.launcher import TritonServer
    from tritonserver_backend.repository import build_repository

    values = {"model_dir": str(EMBEDDED), "registry_root": str(work / "registry"), "engine_dir": str(engines),
              "max_context": "4096", **params}
    repo = build_repository(work / "repo", values)
    server = TritonServer(work_dir=work / "server")
    server.registry_root = Path(values["registry_root"])
    server.start(repo)
    server.wait_ready(240)
    return server
