"""adapter_admin's logic: who may change the registry, from where, within which bounds; validate an adapter against
the network before it enters the registry; audit every action.

`list` is open. `load` (a new name, or an existing one = update) and `unload` need the admin key
(:mod:`.admin_auth`), are refused when administration is turned off (`admin_enabled` = false), take adapter paths
only under the registry root or a configured adapter root, and stay within the bounds of :class:`AdminPolicy`
(checked before the weights file is read). Messages a client gets name its own path only, never the server's layout.
"""

from __future__ import annotations

import json
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError

from ced.formats.checkpoint import load_config
from ced.lora import AdapterError, read_adapter
from ced.lora.peft_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from ced.model.network import CEDNetwork
from tritonserver_backend.adapters.registry import Registry
from tritonserver_backend.adapters.registry_init import description_of
from tritonserver_backend.auth.admin_auth import (
    AUDIT_FILE,
    AdminDenied,
    AdminKeyError,
    AuditLog,
    KeyCheck,
    client_label,
    confine,
    ensure_admin_key,
    key_file_path,
    parse_bool,
    parse_roots,
    scrub,
    server_log,
)
from tritonserver_backend.errors import BadRequest, ServingError

ACTIONS = ("load", "unload", "list")
DEFAULT_MAX_ADAPTERS = 32
DEFAULT_MAX_RANK = 64
DEFAULT_MAX_BYTES = 1 << 30  # adapter_model.safetensors
MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json


@dataclass(frozen=True)
class AdminPolicy:
    """adapter_admin's model parameters (see docs/admin.md)."""

    enabled: bool = True  # admin_enabled: false refuses every action except list
    roots: tuple[Path, ...] = field(default_factory=tuple)  # adapter_roots: allowed besides the registry root
    key_file: Path | None = None  # admin_key_file: default <registry root>/admin.key
    max_adapters: int = DEFAULT_MAX_ADAPTERS
    max_rank: int = DEFAULT_MAX_RANK
    max_bytes: int = DEFAULT_MAX_BYTES

    @classmethod
    def from_params(cls, params: dict[str, str], resolve: Callable[[str], Path]) -> "AdminPolicy":
        """From the model's config parameters; `resolve` maps a path parameter onto the filesystem (project root)."""

        def positive(key: str, default: int) -> int:
            value = int(params.get(key) or default)
            if value < 1:
                raise ValueError(f"adapter_admin parameter {key} must be a positive integer, got {value}")
            return value

        return cls(
            enabled=parse_bool(params.get("admin_enabled"), default=True),
            roots=tuple(parse_roots(params.get("adapter_roots", ""), resolve)),
            key_file=Path(resolve(params["admin_key_file"])) if params.get("admin_key_file") else None,
            max_adapters=positive("max_adapters", DEFAULT_MAX_ADAPTERS),
            max_rank=positive("max_adapter_rank", DEFAULT_MAX_RANK),
            max_bytes=positive("max_adapter_bytes", DEFAULT_MAX_BYTES),
        )


class AdminService:
    def __init__(self, model_dir: str | Path, registry: Registry, policy: AdminPolicy | None = None,
                 log: Callable[[str, str], None] = server_log) -> None:
        self.cfg = load_config(model_dir)
        with torch.device("meta"):
            net = CEDNetwork(self.cfg)
        self.shapes = {n: (m.out_features, m.in_features) for n, m in net.named_modules()
                       if isinstance(m, torch.nn.Linear)}
        self.registry = registry
        self.policy = policy or AdminPolicy()
        self.log = log
        self.roots = (self.registry.root, *self.policy.roots)
        self.key_file = key_file_path(self.registry.root, self.policy.key_file)
        self.keys = KeyCheck(self.key_file)
        self.audit = AuditLog(self.registry.root / AUDIT_FILE)
        self._hide = {str(model_dir): "<model>", str(Path(model_dir).resolve()): "<model>",
                      str(self.key_file): "<key file>"}
        for root in self.roots:
            self._hide.update({str(root): "<adapter root>", str(Path(root).resolve()): "<adapter root>"})
        self._hide.update({str(self.registry.root): "<registry>", str(self.registry.root.resolve()): "<registry>"})
        if self.policy.enabled:
            try:
                ensure_admin_key(self.key_file)
            except (AdminKeyError, OSError) as exc:
                self.log("error", f"adapter_admin: {exc}; load/unload are refused until the key file is fixed")
        else:
            self.log("info", "adapter_admin: administration is turned off (admin_enabled = false); only list is served")

    # ------------------------------------------------------------------------------------------ entry point
    def handle(self, action: str, name: str, path: str, description: str,
               parameters: dict[str, str] | None = None, request_id: str = "") -> str:
        """JSON answer, or a ServingError for the client. Every call is audited (server log + audit.log).
        `parameters` are the request's parameters (forwarded `mol2-*` headers: the admin key)."""
        parameters = parameters or {}
        record = {"action": action, "adapter": name, "path": path, "request_id": request_id,
                  "client": client_label(parameters), "auth": "open" if action == "list" else "none"}
        try:
            result = self._handle(action, name, path, description, parameters, record)
        except ServingError as exc:
            message = scrub(str(exc), path, self._hide)
            self._audit(record, "denied" if isinstance(exc, AdminDenied) else "refused", message)
            raise type(exc)(message) from None
        except Exception as exc:
            self._audit(record, "error", f"internal error ({type(exc).__name__})")
            raise
        self._audit(record, "ok", "" if action == "list" else result)
        return result

    def _audit(self, record: dict, outcome: str, message: str) -> None:
        entry = {**record, "outcome": outcome, "message": message}
        try:
            line = self.audit.write(entry)
        except OSError as exc:
            line = json.dumps(entry)
            self.log("error", f"adapter_admin: cannot append to the audit log {self.audit.path}: {exc.strerror}")
        self.log("info" if outcome == "ok" else "warn", f"adapter_admin audit: {line}")

    def _handle(self, action: str, name: str, path: str, description: str, parameters: dict[str, str],
                record: dict) -> str:
        if action not in ACTIONS:
            raise BadRequest(f"unknown action {action!r}; expected one of {list(ACTIONS)}")
        self.registry.refresh()
        if action == "list":
            return json.dumps({"adapters": [{"name": e.name, "path": e.path, "hash": e.hash,
                                             "description": e.description} for e in self.registry.entries()]})
        if not self.policy.enabled:
            record["auth"] = "disabled"
            raise AdminDenied(f"{action!r} refused: adapter administration is turned off on this server (adapter_admin "
                              "parameter admin_enabled = false); only 'list' is served")
        try:
            self.keys.check(parameters, action)
        except AdminDenied as exc:
            record["auth"] = "missing" if "needs the admin key" in str(exc) else "wrong key"
            raise
        except AdminKeyError as exc:
            record["auth"] = "server key unusable"
            self.log("error", f"adapter_admin: {exc}")
            raise AdminDenied(f"{action!r} refused: the server's admin key is not usable; the operator must fix it "
                              "(see the server log)") from None
        record["auth"] = "key ok"
        if not name:
            raise BadRequest(f"{action} needs an adapter name (input `adapter`)")
        if action == "unload":
            entry = self.registry.remove(name)
            return json.dumps({"unloaded": entry.name, "hash": entry.hash})
        return self._load(name, path, description)

    # ------------------------------------------------------------------------------------------ load
    def _load(self, name: str, path: str, description: str) -> str:
        if not path:
            raise BadRequest("load needs the adapter directory (input `path`)")
        directory = confine(path, self.registry.root, self.roots, files=(ADAPTER_CONFIG, ADAPTER_WEIGHTS))
        names = {e.name for e in self.registry.entries()}
        if name not in names and len(names) >= self.policy.max_adapters:
            raise BadRequest(f"adapter {name!r} refused: {len(names)} adapters are loaded and this server holds at "
                             f"most {self.policy.max_adapters} (adapter_admin parameter max_adapters); unload one "
                             "first")
        config_file, weights_file = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
        sizes = {}
        for f in (config_file, weights_file):
            try:
                st = f.stat()
            except OSError:
                st = None
            if st is None or not stat.S_ISREG(st.st_mode):
                raise BadRequest(f"adapter {name!r}: path {path!r} must hold the files {ADAPTER_CONFIG} and "
                                 f"{ADAPTER_WEIGHTS}")
            sizes[f.name] = st.st_size
        if sizes[ADAPTER_CONFIG] > MAX_CONFIG_BYTES:
            raise BadRequest(f"adapter {name!r} refused: {ADAPTER_CONFIG} is {sizes[ADAPTER_CONFIG]} bytes (at most "
                             f"{MAX_CONFIG_BYTES})")
        if sizes[ADAPTER_WEIGHTS] > self.policy.max_bytes:
            raise BadRequest(f"adapter {name!r} refused: {ADAPTER_WEIGHTS} is {sizes[ADAPTER_WEIGHTS]} bytes; this "
                             f"server accepts at most {self.policy.max_bytes} bytes (adapter_admin parameter "
                             "max_adapter_bytes)")
        try:
            meta = json.loads(config_file.read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            raise BadRequest(f"adapter {name!r}: {ADAPTER_CONFIG} in {path!r} is not readable JSON") from None
        rank = meta.get("r") if isinstance(meta, dict) else None
        if isinstance(rank, int) and rank > self.policy.max_rank:
            raise BadRequest(f"adapter {name!r} refused: rank {rank} is above this server's maximum "
                             f"{self.policy.max_rank} (adapter_admin parameter max_adapter_rank)")
        hide = {**self._hide, str(directory): path}
        try:
            adapter = read_adapter(directory, self.cfg, self.shapes, name, path)
            text = description or description_of(directory)
        except (AdapterError, OSError, ValueError, KeyError, SafetensorError) as exc:
            if isinstance(exc, AdapterError):
                message = str(exc)
            else:  # a file that is not what it claims: say which, without the server's path (OSError names it)
                detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                message = (f"adapter {name!r}: the files in {path!r} are not a readable adapter "
                           f"({type(exc).__name__}: {detail})")
            raise BadRequest(scrub(message, path, hide)) from None
        if adapter.rank > self.policy.max_rank:  # the config said otherwise than the weights: read_adapter checks both
            raise BadRequest(f"adapter {name!r} refused: rank {adapter.rank} is above this server's maximum "
                             f"{self.policy.max_rank}")
        entry = self.registry.put(name, path, text, max_entries=self.policy.max_adapters)
        return json.dumps({"loaded": entry.name, "path": entry.path, "hash": entry.hash, "version": adapter.version,
                           "modules": len(adapter.modules)})
