"""adapter_admin on a real tritonserver: the admin key (forwarded `mol2-admin-key` header), path confinement, load
bounds, the audit trail, and administration turned off (docs/admin.md)."""

from __future__ import annotations

import json
import re
import shutil
import stat
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc  # noqa: F401 - the serve extra installs it: a broken install must fail, not skip

from tests.conftest import EMBEDDED
from tests.tiny import PROJECT_ROOT
from tritonserver_backend.auth.admin_auth import ADMIN_KEY_HEADER, AuditLog, admin_headers
from tritonserver_backend.clients.client import GrpcChat, TurnRequest

pytestmark = pytest.mark.slow
MAX_ADAPTERS, MAX_RANK, MAX_BYTES = 5, 16, 2_000_000  # the bundled four: rank 16, 1.8 MB weights each
WRONG = "not-the-key-" + "x" * 31


def _start(work: Path, params: dict[str, str], keep: tuple[str, ...] | None = None):  # type: ignore[no-untyped-def]
    from tritonserver_backend.launcher import TritonNotFoundError, TritonServer
    from tritonserver_backend.repository import build_repository

    repo = build_repository(work / "repo", params)
    if keep is not None:  # a repository with some models only (the others' folders dropped)
        for model in repo.iterdir():
            if model.name not in keep:
                shutil.rmtree(model)
    try:
        srv = TritonServer(work_dir=work / "server")
    except TritonNotFoundError as exc:
        pytest.fail(f"tritonserver not found although the serve extra is installed: {exc}")
    srv.start(repo)
    try:
        srv.wait_ready(240)
    except BaseException:
        srv.stop()
        raise
    srv.registry_root = Path(params["registry_root"])
    srv.work = work
    return srv


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_engines):  # type: ignore[no-untyped-def]
    work = tmp_path_factory.mktemp("admin-security")
    (work / "extra_root").mkdir()
    params = {"model_dir": str(EMBEDDED), "registry_root": str(work / "registry"), "max_context": "2048",
              "engine_backend": "onnx", "engine_dir": str(default_engines), "adapter_roots": str(work / "extra_root"),
              "max_adapters": str(MAX_ADAPTERS), "max_adapter_rank": str(MAX_RANK), "max_adapter_bytes": str(MAX_BYTES)}
    srv = _start(work, params)
    try:
        yield srv
    finally:
        srv.stop()


def _call(server, transport: str = "http", headers: dict[str, str] | None = None, request_id: str = "", **inputs: str):  # type: ignore[no-untyped-def]
    """adapter_admin over HTTP or gRPC: (result JSON or None, error message or None)."""
    if transport == "http":
        import tritonclient.http as client_lib
        client = client_lib.InferenceServerClient(server.http_url)
    else:
        import tritonclient.grpc as client_lib
        client = client_lib.InferenceServerClient(server.grpc_url)
    tensors = []
    for name, value in inputs.items():
        inp = client_lib.InferInput(name, [1], "BYTES")
        inp.set_data_from_numpy(np.array([value.encode()], dtype=np.object_))
        tensors.append(inp)
    try:
        # http adds to it
        result = client.infer("adapter_admin", tensors, headers=dict(headers) if headers else None,
                              request_id=request_id)
        return json.loads(result.as_numpy("result")[0].decode()), None
    except client_lib.InferenceServerException as exc:
        return None, exc.message() or str(exc)
    finally:
        client.close()


def _key(server) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return admin_headers(server.registry_root)


def _listed(server) -> list[dict]:  # type: ignore[no-untyped-def]
    result, error = _call(server, action="list")
    assert error is None, error
    return result["adapters"]


def _no_server_paths(message: str, server, own: str) -> None:  # type: ignore[no-untyped-def]
    """No absolute path in `message` except the request's own (and nothing of the server's folders)."""
    stripped = message.replace(repr(own), "")
    for location in (server.work, server.registry_root, EMBEDDED, PROJECT_ROOT):
        assert str(location) not in stripped, message
    for path in re.findall(r"(?<![\w.~>-])/[^\s'\"`,;()\[\]{}<>]+", stripped):
        assert path == own or path.startswith(own + "/"), message


def _copy_adapter(server, source: str, dest: Path) -> Path:  # type: ignore[no-untyped-def]
    shutil.copytree(Path(server.registry_root) / "adapters" / source, dest, dirs_exist_ok=True)
    return dest


def test_list_is_open_and_the_key_file_is_owner_only(server) -> None:  # type: ignore[no-untyped-def]
    names = [a["name"] for a in _listed(server)]
    assert names == ["L0_chat", "L1_agent", "L2_code", "L3_design"]
    key_file = Path(server.registry_root) / "admin.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and len(key_file.read_text().strip()) >= 32
    assert ("--grpc-header-forward-pattern=mol2-.*" in server.command
            and "--http-header-forward-pattern=mol2-.*" in server.command)


def test_load_and_unload_without_or_with_a_wrong_key_change_nothing(server) -> None:  # type: ignore[no-untyped-def]
    chat = GrpcChat(server.grpc_url)
    first = TurnRequest("live", "def mean(xs):\n    return sum(xs) / len(xs)", new_session=True, max_tokens=4)
    before = chat.turn(first)
    assert before.error is None, before.error
    routed = before.adapter
    assert routed != "base", "the routed turn picked an adapter"
    registry_file = Path(server.registry_root) / "registry.json"
    registry_before, listed_before = registry_file.read_text(), _listed(server)
    evil = _copy_adapter(server, "L0_chat", Path(server.registry_root) / "adapters" / "evil")
    attempts = [dict(action="unload", adapter=routed), dict(action="load", adapter=routed, path="adapters/evil"),
                dict(action="load", adapter="evil", path="adapters/evil")]
    for transport in ("http", "grpc"):
        for headers, reason in [(None, "needs the admin key: send it in the request header 'mol2-admin-key'"),
                                ({ADMIN_KEY_HEADER: WRONG}, "wrong admin key"),
                                ({"Mol2-Admin-Key": WRONG}, "wrong admin key"),
                                ({"mol2-admin-keyx": _key(server)[ADMIN_KEY_HEADER]}, "needs the admin key")]:
            if transport == "grpc" and headers and any(k != k.lower() for k in headers):
                continue  # gRPC metadata keys are lower case
            for inputs in attempts:
                result, error = _call(server, transport, headers, **inputs)
                assert result is None and error is not None and reason in error, (transport, headers, inputs, error)
    assert registry_file.read_text() == registry_before and _listed(server) == listed_before
    again = chat.turn(TurnRequest("live-2", first.text, new_session=True, max_tokens=4))
    assert again.error is None and again.adapter == routed and again.token_ids == before.token_ids
    follow = chat.turn(TurnRequest("live", "And the median?", adapter=routed, max_tokens=3))
    assert follow.error is None and follow.adapter == routed, "the live conversation still has its adapter"
    chat.close()
    shutil.rmtree(evil)


def test_paths_outside_the_roots_are_refused_without_server_paths(server) -> None:  # type: ignore[no-untyped-def]
    registry = Path(server.registry_root)
    # a valid adapter, outside the roots
    outside = _copy_adapter(server, "L1_agent", server.work / "outside" / "adapter")
    (registry / "adapters" / "escape").symlink_to(outside)
    mixed = registry / "adapters" / "mixed"
    mixed.mkdir()
    shutil.copy(outside / "adapter_config.json", mixed)
    (mixed / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    listed_before = _listed(server)
    cases = {
        "../../etc": "'..' is not allowed",
        "../../../../../../etc": "'..' is not allowed",
        "adapters/../../outside/adapter": "'..' is not allowed",
        "/etc": "must lie under the registry root or a configured adapter root",
        str(outside): "must lie under the registry root or a configured adapter root",
        "adapters/escape": "must lie under the registry root or a configured adapter root",
        "adapters/mixed": "adapter_model.safetensors links outside",
        "adapters/nothing_here": "must hold the files adapter_config.json and adapter_model.safetensors",
        str(registry / "adapters" / "nothing_here"): "must hold the files",
        str(server.work / "extra_root" / "missing"): "must hold the files",
    }
    for path, reason in cases.items():
        for transport in ("http", "grpc"):
            result, error = _call(server, transport, _key(server), action="load", adapter="intruder", path=path)
            assert result is None and error is not None and reason in error and repr(path) in error, (path, error)
            _no_server_paths(error, server, path)
    assert _listed(server) == listed_before
    (registry / "adapters" / "escape").unlink()
    shutil.rmtree(mixed)


def _rank_adapter(directory: Path, rank: int) -> None:
    """A well-formed adapter of `rank` on one decoder module (it would load where the rank bound allows it)."""
    import torch
    from safetensors.torch import load_file

    from ced.lora import save_adapter

    weights = load_file(str(EMBEDDED / "adapters" / "L1_agent" / "adapter_model.safetensors"))
    key_a = sorted(k for k in weights if k.endswith(".lora_A.weight"))[0]
    module = key_a.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
    in_f, out_f = weights[key_a].shape[1], weights[key_a.replace("lora_A", "lora_B")].shape[0]
    save_adapter(directory, {module: (torch.zeros(rank, in_f), torch.zeros(out_f, rank))}, rank, 2.0 * rank,
                 "mol2-small")


def test_oversize_over_rank_and_too_many_loads_are_refused(server) -> None:  # type: ignore[no-untyped-def]
    registry = Path(server.registry_root)
    headers = _key(server)
    registry_before = (registry / "registry.json").read_text()
    big = _copy_adapter(server, "L1_agent", registry / "adapters" / "big")
    with open(big / "adapter_model.safetensors", "r+b") as fh:
        fh.truncate(MAX_BYTES + 1)
    result, error = _call(server, "http", headers, action="load", adapter="big", path="adapters/big")
    assert (error is not None
            and f"adapter_model.safetensors is {MAX_BYTES + 1} bytes; this server accepts at most {MAX_BYTES} bytes"
            in error), error
    _rank_adapter(registry / "adapters" / "wide", 2 * MAX_RANK)
    result, error = _call(server, "grpc", headers, action="load", adapter="wide", path="adapters/wide")
    assert error is not None and f"rank {2 * MAX_RANK} is above this server's maximum {MAX_RANK}" in error, error
    _rank_adapter(registry / "adapters" / "narrow", MAX_RANK // 2)  # the same kind of adapter within the bound loads
    assert (registry / "registry.json").read_text() == registry_before, "nothing was loaded"
    result, error = _call(server, "http", headers, action="load", adapter="narrow", path="adapters/narrow",
                          description="a narrow one")
    assert error is None and result["loaded"] == "narrow", error
    assert len(_listed(server)) == MAX_ADAPTERS
    _copy_adapter(server, "L2_code", registry / "adapters" / "one_more")
    result, error = _call(server, "http", headers, action="load", adapter="one_more", path="adapters/one_more")
    assert (error is not None
            and f"{MAX_ADAPTERS} adapters are loaded and this server holds at most {MAX_ADAPTERS}" in error), error
    assert "one_more" not in [a["name"] for a in _listed(server)]
    # an update does not count
    result, error = _call(server, "http", headers, action="load", adapter="narrow", path="adapters/narrow")
    assert error is None and result["loaded"] == "narrow", error
    result, error = _call(server, "http", headers, action="unload", adapter="narrow")
    assert error is None and (registry / "registry.json").read_text() == registry_before
    for name in ("big", "wide", "narrow", "one_more"):
        shutil.rmtree(registry / "adapters" / name)


def test_with_the_key_load_update_unload_work(server) -> None:  # type: ignore[no-untyped-def]
    registry = Path(server.registry_root)
    headers = _key(server)
    chat = GrpcChat(server.grpc_url)
    entry = next(a for a in _listed(server) if a["name"] == "L3_design")
    result, error = _call(server, "grpc", headers, action="unload", adapter="L3_design")
    assert error is None and result["unloaded"] == "L3_design"
    reply = chat.turn(TurnRequest("keyed", "A CSS grid, please.", new_session=True, adapter="L3_design", max_tokens=3))
    assert reply.error is not None and "unknown adapter 'L3_design'" in reply.error
    result, error = _call(server, "http", headers, action="load", adapter="L3_design", path=entry["path"],
                          description=entry["description"])
    assert error is None and result["hash"] == entry["hash"]
    assert chat.turn(TurnRequest("keyed", "A CSS grid, please.", new_session=True, adapter="L3_design",
                                 max_tokens=3)).adapter == "L3_design"
    # update: new weights at the same path get a new version under the same hash
    upd = _copy_adapter(server, "L1_agent", registry / "adapters" / "upd")
    first, error = _call(server, "http", headers, action="load", adapter="upd", path="adapters/upd")
    assert error is None, error
    shutil.copy(registry / "adapters" / "L2_code" / "adapter_model.safetensors", upd / "adapter_model.safetensors")
    second, error = _call(server, "grpc", headers, action="load", adapter="upd", path="adapters/upd")
    assert error is None and second["hash"] == first["hash"] and second["version"] != first["version"], (first, second)
    assert chat.turn(TurnRequest("keyed", "Next.", adapter="upd", max_tokens=3)).adapter == "upd"
    assert _call(server, "http", headers, action="unload", adapter="upd")[1] is None
    # an absolute path under a configured adapter root (adapter_roots) is allowed
    ext = _copy_adapter(server, "L0_chat", server.work / "extra_root" / "ext")
    result, error = _call(server, "http", headers, action="load", adapter="ext", path=str(ext))
    assert error is None and result["path"] == str(ext), error
    # the curl form in docs/admin.md: KServe v2 JSON with the key in a header
    body = {"inputs": [{"name": "action", "datatype": "BYTES", "shape": [1], "data": ["unload"]},
                       {"name": "adapter", "datatype": "BYTES", "shape": [1], "data": ["ext"]}]}
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/adapter_admin/infer",
                                     data=json.dumps(body).encode(),
                                     headers={**headers, "Content-Type": "application/json"})
    answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
    assert json.loads(answer["outputs"][0]["data"][0])["unloaded"] == "ext"
    assert [a["name"] for a in _listed(server)] == ["L0_chat", "L1_agent", "L2_code", "L3_design"]
    chat.close()
    shutil.rmtree(upd)


def test_every_action_is_audited_without_the_key(server) -> None:  # type: ignore[no-untyped-def]
    headers = _key(server)
    _call(server, "http", {ADMIN_KEY_HEADER: WRONG, "mol2-client": "auditor"}, request_id="audit-1", action="unload",
          adapter="L0_chat")
    _call(server, "http", {**headers, "mol2-client": "auditor"}, request_id="audit-2", action="load", adapter="x",
          path="/etc")
    records = AuditLog(Path(server.registry_root) / "audit.log").records()
    by_id = {r["request_id"]: r for r in records if r["request_id"]}
    assert (by_id["audit-1"]["outcome"] == "denied" and by_id["audit-1"]["auth"] == "wrong key"
            and by_id["audit-1"]["client"] == "auditor")
    assert (by_id["audit-2"]["outcome"] == "refused" and by_id["audit-2"]["auth"] == "key ok"
            and "'/etc' is refused" in by_id["audit-2"]["message"])
    outcomes = {(r["action"], r["outcome"]) for r in records}
    assert {("list", "ok"), ("load", "ok"), ("unload", "ok"), ("load", "denied"), ("unload", "denied"),
            ("load", "refused")} <= outcomes
    assert stat.S_IMODE((Path(server.registry_root) / "audit.log").stat().st_mode) == 0o600
    log = Path(server.log_file).read_text(errors="replace")
    assert "adapter_admin audit:" in log and "audit-1" in log
    key = headers[ADMIN_KEY_HEADER]
    assert key not in log and key not in (Path(server.registry_root) / "audit.log").read_text()


def test_administration_turned_off_serves_list_only(tmp_path_factory) -> None:  # type: ignore[no-untyped-def]
    work = tmp_path_factory.mktemp("admin-off")
    params = {"model_dir": str(EMBEDDED), "registry_root": str(work / "registry"), "admin_enabled": "false"}
    srv = _start(work, params, keep=("adapter_admin",))
    try:
        assert [a["name"] for a in _listed(srv)] == ["L0_chat", "L1_agent", "L2_code", "L3_design"]
        assert not (work / "registry" / "admin.key").exists(), "no key is made when administration is off"
        for inputs in (dict(action="unload", adapter="L0_chat"),
                       dict(action="load", adapter="L9", path="adapters/L0_chat")):
            result, error = _call(srv, "http", {ADMIN_KEY_HEADER: WRONG}, **inputs)
            assert error is not None and "adapter administration is turned off on this server" in error, error
        assert len(_listed(srv)) == 4
    finally:
        srv.stop()
