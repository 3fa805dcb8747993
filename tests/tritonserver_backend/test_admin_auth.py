"""adapter_admin's security helpers without a server: the key file, key checks, path confinement, message scrubbing,
the audit log, and AdminService's auth gate, bounds and messages on the embedded default's network."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest

from tests.conftest import EMBEDDED
from tritonserver_backend.adapters.registry import Registry
from tritonserver_backend.auth.admin_auth import (
    ADMIN_KEY_HEADER,
    AdminDenied,
    AdminKeyError,
    AuditLog,
    KeyCheck,
    PathRefused,
    admin_headers,
    admin_key,
    confine,
    ensure_admin_key,
    keys_match,
    parse_bool,
    parse_roots,
    read_admin_key,
    request_parameters,
    rotate_admin_key,
    scrub,
)
from tritonserver_backend.errors import BadRequest

FILES = ("adapter_config.json", "adapter_model.safetensors")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _absolute_paths(message: str) -> list[str]:
    return re.findall(r"(?<![\w.~-])/[^\s'\"`,;()\[\]{}<>]+", message)


# ---------------------------------------------------------------------------------------------- key file
def test_key_file_is_created_owner_only_once_and_read_back(tmp_path: Path) -> None:
    old = os.umask(0)  # even a permissive umask gives 0600
    try:
        key = ensure_admin_key(tmp_path / "reg" / "admin.key")
    finally:
        os.umask(old)
    path = tmp_path / "reg" / "admin.key"
    assert _mode(path) == 0o600 and len(key) >= 32
    assert ensure_admin_key(path) == key, "a second start keeps the key"
    assert admin_key(tmp_path / "reg") == key and admin_headers(tmp_path / "reg") == {ADMIN_KEY_HEADER: key}
    assert admin_key(tmp_path / "elsewhere", key_file=path) == key


def test_unsafe_short_or_missing_key_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "admin.key"
    with pytest.raises(AdminKeyError, match="does not exist"):
        read_admin_key(path)
    path.write_text("k" * 40)
    path.chmod(0o644)
    with pytest.raises(AdminKeyError, match="mode 0644; it must be 0600"):
        read_admin_key(path)
    path.chmod(0o600)
    assert read_admin_key(path) == "k" * 40
    path.write_text("short\n")
    with pytest.raises(AdminKeyError, match="at least 16"):
        read_admin_key(path)


def test_rotation_replaces_the_key_and_a_running_check_follows_it(tmp_path: Path) -> None:
    path = tmp_path / "admin.key"
    first = ensure_admin_key(path)
    check = KeyCheck(path)
    check.check({ADMIN_KEY_HEADER: first}, "load")
    second = rotate_admin_key(path)
    assert second != first and _mode(path) == 0o600 and read_admin_key(path) == second
    with pytest.raises(AdminDenied, match="wrong admin key"):
        check.check({ADMIN_KEY_HEADER: first}, "load")
    check.check({ADMIN_KEY_HEADER: second}, "load")
    with pytest.raises(ValueError):
        rotate_admin_key(path, "too short")


def test_key_check_missing_wrong_right_and_header_case(tmp_path: Path) -> None:
    key = ensure_admin_key(tmp_path / "admin.key")
    check = KeyCheck(tmp_path / "admin.key")
    with pytest.raises(AdminDenied, match="needs the admin key: send it in the request header 'mol2-admin-key'"):
        check.check({"mol2-client": "me"}, "unload")
    for wrong in ("", key[:-1], key + "x", key.upper() if key.upper() != key else key + "A"):
        with pytest.raises(AdminDenied, match="wrong admin key"):
            check.check({ADMIN_KEY_HEADER: wrong}, "unload")
    check.check({"Mol2-Admin-Key": key}, "unload")  # HTTP keeps the header's case
    with pytest.raises(AdminDenied):  # two copies, one wrong: refused
        check.check({"Mol2-Admin-Key": key, ADMIN_KEY_HEADER: "nope" * 8}, "unload")
    assert keys_match(key, key) and not keys_match(key, key[:-1]) and not keys_match("", key)
    (tmp_path / "admin.key").chmod(0o640)
    with pytest.raises(AdminKeyError):
        check.check({ADMIN_KEY_HEADER: key}, "unload")


def test_request_parameters_reads_forwarded_headers() -> None:
    class Request:
        def __init__(self, raw):  # type: ignore[no-untyped-def]
            self.raw = raw

        def parameters(self):  # type: ignore[no-untyped-def]
            return self.raw

    assert request_parameters(Request('{"Mol2-Admin-Key": "abc", "n": 3}')) == {"Mol2-Admin-Key": "abc", "n": "3"}
    assert request_parameters(Request("")) == {} and request_parameters(Request("[1]")) == {}
    assert request_parameters(object()) == {}


def test_parse_helpers(tmp_path: Path) -> None:
    assert parse_bool("false") is False and parse_bool("TRUE") is True and parse_bool("", default=True) is True
    with pytest.raises(ValueError):
        parse_bool("maybe")
    roots = parse_roots("a: /abs/b ::", lambda v: tmp_path / v if not v.startswith("/") else Path(v))
    assert roots == [tmp_path / "a", Path("/abs/b")]


# ---------------------------------------------------------------------------------------------- paths
@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    """registry/adapters/good, an extra root with an adapter, and a folder outside both holding an adapter."""
    registry, extra, outside = tmp_path / "registry", tmp_path / "extra", tmp_path / "outside"
    for d in (registry / "adapters" / "good", extra / "ext", outside / "secret"):
        d.mkdir(parents=True)
        for f in FILES:
            (d / f).write_text("{}")
    return {"registry": registry, "extra": extra, "outside": outside, "tmp": tmp_path}


def test_confine_accepts_paths_under_the_roots(layout) -> None:  # type: ignore[no-untyped-def]
    reg, extra = layout["registry"], layout["extra"]
    roots = [reg, extra]
    assert confine("adapters/good", reg, roots, FILES) == (reg / "adapters" / "good").resolve()
    assert confine(str(extra / "ext"), reg, roots, FILES) == (extra / "ext").resolve()
    (reg / "adapters" / "alias").symlink_to(reg / "adapters" / "good")  # a symlink that stays inside is fine
    assert confine("adapters/alias", reg, roots, FILES) == (reg / "adapters" / "good").resolve()


def test_confine_refuses_traversal_absolute_and_escaping_symlinks(layout) -> None:  # type: ignore[no-untyped-def]
    reg, outside, tmp = layout["registry"], layout["outside"], layout["tmp"]
    (reg / "adapters" / "escape").symlink_to(outside / "secret")
    (reg / "adapters" / "mixed").mkdir()
    (reg / "adapters" / "mixed" / FILES[0]).write_text("{}")
    (reg / "adapters" / "mixed" / FILES[1]).symlink_to(outside / "secret" / FILES[1])
    (reg / "adapters" / "loop").symlink_to(reg / "adapters" / "loop")
    cases = {
        "../../etc": "'..' is not allowed",
        "adapters/../../outside/secret": "'..' is not allowed",
        "/etc": "must lie under the registry root",
        str(outside / "secret"): "must lie under the registry root",
        "adapters/escape": "must lie under the registry root",
        "adapters/mixed": "adapter_model.safetensors links outside",
        "adapters/loop": "refused",
        "": "not a usable path",
        "a\x00b": "not a usable path",
    }
    for path, reason in cases.items():
        with pytest.raises(PathRefused, match=re.escape(reason)) as info:
            confine(path, reg, [reg], FILES)
        message = str(info.value)
        assert str(tmp) not in message.replace(repr(path), ""), message
        assert all(p == path for p in _absolute_paths(message)), message


def test_scrub_hides_server_paths_but_keeps_the_request_path(tmp_path: Path) -> None:
    root = str(tmp_path / "registry")
    message = f"adapter 'x': {root}/adapters/x must hold files; see /opt/other/place and /etc/passwd"
    out = scrub(message, "/etc", {root: "<registry>"})
    assert root not in out and "/opt/other" not in out and "<registry>/adapters/x" in out and "/etc/passwd" in out
    assert "/etc/passwd" not in scrub(message, "adapters/x", {root: "<registry>"})
    assert (scrub("shapes A (16, 64) / B (64, 16); see docs/admin.md and ../x", "p", {})
            == "shapes A (16, 64) / B (64, 16); see docs/admin.md and ../x")


def test_audit_log_appends_json_lines_owner_only(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "reg" / "audit.log")
    log.write({"action": "load", "outcome": "ok"})
    log.write({"action": "unload", "outcome": "denied", "adapter": "a\nb"})
    assert _mode(log.path) == 0o600
    lines = log.path.read_text().splitlines()
    assert (len(lines) == 2 and [r["action"] for r in log.records()] == ["load", "unload"]
            and log.records()[1]["adapter"] == "a\nb")


def test_registry_put_bounds_the_count_under_its_lock(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    reg.put("a", "adapters/a", "")
    reg.put("b", "adapters/b", "", max_entries=2)
    reg.put("a", "adapters/a", "new text", max_entries=2)  # an update never counts
    with pytest.raises(BadRequest, match="at most 2"):
        reg.put("c", "adapters/c", "", max_entries=2)
    assert [e.name for e in reg.entries()] == ["a", "b"] and len(reg) == 2
    with pytest.raises(BadRequest, match="invalid adapter name"):
        reg.put("bad\nname", "adapters/d", "")


def test_launcher_forwards_mol2_headers(tmp_path: Path) -> None:
    from tritonserver_backend.launcher import TritonServer
    from tritonserver_backend.launcher.install import TritonInstall

    server = TritonServer(TritonInstall(binary=tmp_path / "tritonserver", source="system", backend_dir=None),
                          work_dir=tmp_path / "w")
    server.http_port, server.grpc_port, server.metrics_port = 1, 2, 3
    cmd = server.build_command(tmp_path, tmp_path / "b")
    assert "--grpc-header-forward-pattern=mol2-.*" in cmd and "--http-header-forward-pattern=mol2-.*" in cmd
    cmd = server.build_command(tmp_path, tmp_path / "b", ["--http-header-forward-pattern=mol2-.*|x-request-id"])
    assert ([a for a in cmd if a.startswith("--http-header-forward-pattern")]
            == ["--http-header-forward-pattern=mol2-.*|x-request-id"])


# ---------------------------------------------------------------------------------------------- AdminService
@pytest.fixture
def service(tmp_path: Path):  # type: ignore[no-untyped-def]
    from tritonserver_backend.adapters.admin_service import AdminPolicy, AdminService
    from tritonserver_backend.adapters.registry_init import ensure_registry

    def make(**policy):  # type: ignore[no-untyped-def]
        registry = ensure_registry(tmp_path / "registry", EMBEDDED)
        logs: list[tuple[str, str]] = []
        svc = AdminService(EMBEDDED, registry, AdminPolicy(**policy),
                           log=lambda level, line: logs.append((level, line)))
        svc.logs = logs  # type: ignore[attr-defined]
        return svc

    return make


def _names(svc) -> list[str]:  # type: ignore[no-untyped-def]
    return [a["name"] for a in json.loads(svc.handle("list", "", "", ""))["adapters"]]


def test_service_requires_the_key_for_load_and_unload_and_audits(service, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    svc = service()
    root = svc.registry.root
    headers = admin_headers(root)
    before = _names(svc)
    for params in ({}, {ADMIN_KEY_HEADER: "w" * 43}):
        with pytest.raises(AdminDenied):
            svc.handle("unload", "L0_chat", "", "", parameters=params)
        with pytest.raises(AdminDenied):
            svc.handle("load", "L0_chat", "adapters/L1_agent", "", parameters=params)
    assert _names(svc) == before
    assert json.loads(svc.handle("unload", "L0_chat", "", "", parameters=headers))["unloaded"] == "L0_chat"
    assert json.loads(svc.handle("load", "L0_chat", "adapters/L0_chat", "",
                                 parameters={**headers, "mol2-client": "ops"}))["loaded"] == "L0_chat"
    records = AuditLog(root / "audit.log").records()
    assert [(r["action"], r["outcome"], r["auth"]) for r in records] == [
        ("list", "ok", "open"), ("unload", "denied", "missing"), ("load", "denied", "missing"),
        ("unload", "denied", "wrong key"),
        ("load", "denied", "wrong key"), ("list", "ok", "open"), ("unload", "ok", "key ok"), ("load", "ok", "key ok")]
    assert records[-1]["client"] == "ops"
    assert (not any(headers[ADMIN_KEY_HEADER] in line for _, line in svc.logs)
            and headers[ADMIN_KEY_HEADER] not in (root / "audit.log").read_text())
    assert any(level == "warn" and '"outcome": "denied"' in line for level, line in svc.logs)


def test_service_turned_off_serves_list_only(service) -> None:  # type: ignore[no-untyped-def]
    svc = service(enabled=False)
    headers = (admin_headers(svc.registry.root) if (svc.registry.root / "admin.key").exists()
               else {ADMIN_KEY_HEADER: "x" * 40})
    assert len(_names(svc)) == 4
    for action in ("load", "unload"):
        with pytest.raises(AdminDenied, match="administration is turned off on this server"):
            svc.handle(action, "L0_chat", "adapters/L0_chat", "", parameters=headers)
    assert len(_names(svc)) == 4


def test_service_bounds_refuse_before_anything_changes(service, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from ced.lora.peft_io import ADAPTER_WEIGHTS

    svc = service(max_adapters=4, max_rank=16, max_bytes=2_000_000)
    root = svc.registry.root
    headers = admin_headers(root)
    before = svc.registry.file.read_text()
    shutil.copytree(root / "adapters" / "L1_agent", root / "adapters" / "extra")
    with pytest.raises(BadRequest, match=r"4 adapters are loaded and this server holds at most 4 \(adapter_admin "
                                         r"parameter max_adapters\)"):
        svc.handle("load", "extra", "adapters/extra", "", parameters=headers)
    svc.handle("unload", "L3_design", "", "", parameters=headers)
    big = root / "adapters" / "big"
    shutil.copytree(root / "adapters" / "L1_agent", big)
    with open(big / ADAPTER_WEIGHTS, "r+b") as fh:
        fh.truncate(2_000_001)
    with pytest.raises(BadRequest, match=r"is 2000001 bytes; this server accepts at most 2000000 bytes \(adapter_admin "
                                         r"parameter max_adapter_bytes\)"):
        svc.handle("load", "big", "adapters/big", "", parameters=headers)
    wide = root / "adapters" / "wide"
    shutil.copytree(root / "adapters" / "L1_agent", wide)
    cfg = json.loads((wide / "adapter_config.json").read_text())
    (wide / "adapter_config.json").write_text(json.dumps({**cfg, "r": 32}))
    with pytest.raises(BadRequest,
                       match=r"rank 32 is above this server's maximum 16 \(adapter_admin parameter max_adapter_rank\)"):
        svc.handle("load", "wide", "adapters/wide", "", parameters=headers)
    # a broken weights file and a missing folder: the messages never name the server's folders
    broken = root / "adapters" / "broken"
    shutil.copytree(root / "adapters" / "L1_agent", broken)
    (broken / ADAPTER_WEIGHTS).write_bytes(b"\x00" * 64)
    for path in ("adapters/broken", "adapters/missing", str(root / "adapters" / "missing")):
        with pytest.raises(BadRequest) as info:
            svc.handle("load", "broken", path, "", parameters=headers)
        message = str(info.value)
        assert (str(tmp_path) not in message.replace(repr(path), "")
                and all(p == path or p.startswith(path + "/") for p in _absolute_paths(message))), message
    assert _names(svc) == ["L0_chat", "L1_agent", "L2_code"]
    svc.handle("load", "L3_design", "adapters/L3_design", "", parameters=headers)
    assert svc.registry.file.read_text() == before
