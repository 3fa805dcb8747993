"""Who may administer adapters, and where from: the admin key, path confinement, the audit log.

* The admin key is a server-side secret in a file with owner-only permissions (0600), created at the first start
  of `adapter_admin` (default `<registry root>/admin.key`, or the model parameter `admin_key_file`). Clients send it
  in the request header `mol2-admin-key`; tritonserver forwards headers matching `--grpc-header-forward-pattern` /
  `--http-header-forward-pattern` (the launcher passes `mol2-.*`) to the model as request parameters, where
  :func:`request_parameters` reads them. The comparison is constant-time (`hmac.compare_digest`).
* :func:`confine` maps a client's adapter path onto the filesystem only inside the allowed roots (the registry root
  and the configured `adapter_roots`): `..` components, absolute paths elsewhere and symlinks that resolve outside
  are refused, and the refusal names the client's own path only.
* :class:`AuditLog` appends one JSON line per admin action to `<registry root>/audit.log`.

Local tools on the server's machine get the key with :func:`admin_key` / :func:`admin_headers`;
`python -m tritonserver_backend.auth.admin_auth show|rotate --registry-root DIR` prints or replaces it.
Nothing here imports Triton at module level (pb_utils is imported lazily, for the server log only).
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import re
import secrets
import stat
import sys
import time
from pathlib import Path
from typing import Any, Iterable

from tritonserver_backend.errors import BadRequest, ServingError

ADMIN_KEY_HEADER = "mol2-admin-key"
CLIENT_HEADER = "mol2-client"  # optional, self-declared client label recorded in the audit log (not authenticated)
HEADER_FORWARD_PATTERN = "mol2-.*"  # what the launcher passes to --grpc/--http-header-forward-pattern
KEY_FILE = "admin.key"
AUDIT_FILE = "audit.log"
MIN_KEY_CHARS = 16

LOG = logging.getLogger("mol2.admin")


class AdminDenied(ServingError):
    """A privileged admin action without a valid admin key (or with administration turned off)."""


class PathRefused(BadRequest):
    """An adapter path outside the allowed roots."""


class AdminKeyError(Exception):
    """The server-side key file is missing, unreadable or unsafe (a server problem: never shown to clients)."""


# ---------------------------------------------------------------------------------------------- the key file
def key_file_path(registry_root: str | Path, key_file: str | Path | None = None) -> Path:
    return Path(key_file) if key_file else Path(registry_root) / KEY_FILE


def _new_key() -> str:
    return secrets.token_urlsafe(32)


def ensure_admin_key(path: str | Path) -> str:
    """The key in `path`, created (0600, a fresh random key) when the file does not exist; checked like
    :func:`read_admin_key`. Safe when processes race (the models of one server start at once): the key is written to
    a private temporary file and hard-linked into place, which either creates `path` whole or finds it there, so no
    process ever reads a created but not yet written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        return read_admin_key(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (_new_key() + "\n").encode())
    finally:
        os.close(fd)
    try:
        os.link(partial, path)  # atomic, and refuses to replace: the first process to get here wins
    except FileExistsError:
        pass
    finally:
        partial.unlink()
    return read_admin_key(path)


def read_admin_key(path: str | Path) -> str:
    """The key in `path`; AdminKeyError when the file is missing, not a regular file, readable or writable by group
    or others (it must be 0600 or stricter), or holds fewer than 16 characters. A symlink is followed (a mounted
    secret); its target is what is checked."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise AdminKeyError(f"admin key file {path} does not exist (it is created at the first start of "
                            "adapter_admin)") from None
    except OSError as exc:
        raise AdminKeyError(f"admin key file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise AdminKeyError(f"admin key file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise AdminKeyError(f"admin key file {path} has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0600 "
                            f"(chmod 600 {path})")
    try:
        key = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise AdminKeyError(f"admin key file {path} is unreadable: {exc}") from None
    if len(key) < MIN_KEY_CHARS:
        raise AdminKeyError(f"admin key file {path} holds {len(key)} characters; at least {MIN_KEY_CHARS} are needed")
    return key


def rotate_admin_key(path: str | Path, key: str | None = None) -> str:
    """Replace the key atomically (a new random one unless given); the server uses it from its next admin request."""
    path = Path(path)
    key = key if key is not None else _new_key()
    if len(key.strip()) < MIN_KEY_CHARS:
        raise ValueError(f"an admin key needs at least {MIN_KEY_CHARS} characters")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (key.strip() + "\n").encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return key.strip()


def admin_key(registry_root: str | Path, key_file: str | Path | None = None) -> str:
    """For clients on the server's machine (same user): the admin key of the server using `registry_root`."""
    return read_admin_key(key_file_path(registry_root, key_file))


def admin_headers(registry_root: str | Path, key_file: str | Path | None = None) -> dict[str, str]:
    """`headers=` for tritonclient's `infer` (HTTP or gRPC) carrying the admin key."""
    return {ADMIN_KEY_HEADER: admin_key(registry_root, key_file)}


def keys_match(presented: str, expected: str) -> bool:
    """Constant-time comparison (the time does not depend on where the strings differ)."""
    return hmac.compare_digest(presented.encode("utf-8", "surrogateescape"),
                               expected.encode("utf-8", "surrogateescape"))


class KeyCheck:
    """Checks a request's key against the key file, re-read whenever the file changes (rotation needs no restart)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int, int, int] | None = None
        self._key: str | None = None

    def expected(self) -> str:
        try:
            st = self.path.stat()
        except OSError:
            st = None
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size, st.st_mode) if st is not None else None
        if stamp is None or stamp != self._stamp or self._key is None:
            self._key, self._stamp = None, None
            self._key = read_admin_key(self.path)  # AdminKeyError: a server problem, logged by the caller
            self._stamp = stamp
        return self._key

    def check(self, parameters: dict[str, str], action: str) -> None:
        """Raise AdminDenied unless the request carries the right key. AdminKeyError when the server has none."""
        presented = [v for k, v in parameters.items() if k.lower() == ADMIN_KEY_HEADER]
        if not presented:
            raise AdminDenied(f"{action!r} needs the admin key: send it in the request header {ADMIN_KEY_HEADER!r} "
                              "(see docs/admin.md)")
        expected = self.expected()
        if not all(keys_match(p, expected) for p in presented):
            raise AdminDenied(f"{action!r} refused: wrong admin key")


# ---------------------------------------------------------------------------------------------- requests
def request_parameters(request: Any) -> dict[str, str]:
    """The request's parameters (forwarded `mol2-*` headers included) as strings. Header names keep the case the
    client sent over HTTP, so compare keys case-insensitively."""
    try:
        raw = request.parameters()
    except AttributeError:  # a Python backend without parameters(): no forwarded headers either
        return {}
    try:
        data = json.loads(raw) if isinstance(raw, str) else dict(raw or {})
    except (TypeError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def request_id(request: Any) -> str:
    try:
        return str(request.request_id() or "")
    except AttributeError:
        return ""


def client_label(parameters: dict[str, str]) -> str:
    """The self-declared `mol2-client` header, shortened (the Python backend does not expose the peer address)."""
    for k, v in parameters.items():
        if k.lower() == CLIENT_HEADER:
            return v[:200]
    return ""


# ---------------------------------------------------------------------------------------------- paths
def parse_bool(value: str | bool | None, default: bool = True) -> bool:
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def parse_roots(text: str, resolve: Any) -> list[Path]:
    """`adapter_roots`: colon-separated folders, each through `resolve` (relative to the project root)."""
    return [Path(resolve(part.strip())) for part in (text or "").split(":") if part.strip()]


def _inside(path: Path, roots: Iterable[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in roots)


def confine(path_text: str, base: str | Path, roots: Iterable[str | Path], files: Iterable[str] = ()) -> Path:
    """The resolved directory of a client's adapter path, or PathRefused.

    Relative paths are relative to `base` (the registry root); `..` components are refused outright; the path with
    every symlink resolved must lie under one of `roots` (resolved too), and so must each of `files` inside it that
    exists. Messages name `path_text` only."""
    if not path_text or "\x00" in path_text or len(path_text) > 4096:
        raise PathRefused(f"path {path_text[:200]!r} is refused: not a usable path")
    given = Path(path_text)
    if ".." in given.parts:
        raise PathRefused(f"path {path_text!r} is refused: '..' is not allowed in adapter paths")
    resolved_roots = [Path(r).resolve() for r in roots]
    candidate = given if given.is_absolute() else Path(base) / given
    try:
        resolved = candidate.resolve()
    except (OSError, RuntimeError):  # a symlink loop
        raise PathRefused(f"path {path_text!r} is refused: it cannot be resolved") from None
    if not _inside(resolved, resolved_roots):
        raise PathRefused(f"path {path_text!r} is refused: adapters must lie under the registry root or a configured "
                          "adapter root (adapter_roots)")
    for name in files:
        inner = resolved / name
        if inner.is_symlink() or inner.exists():
            try:
                target = inner.resolve()
            except (OSError, RuntimeError):
                raise PathRefused(f"path {path_text!r} is refused: its {name} cannot be resolved") from None
            if not _inside(target, resolved_roots):
                raise PathRefused(f"path {path_text!r} is refused: its {name} links outside the allowed adapter roots")
    return resolved


_ABSOLUTE = re.compile(r"(?<![\w.~>\x00-])/[^\s'\"`,;()\[\]{}<>\x00]+")
_OWN = "\x00own\x00"


def scrub(message: str, request_path: str, replacements: dict[str, str]) -> str:
    """`message` without the server's layout: the client's own path stays as it sent it; each known server location
    becomes its label (longest first); any other absolute path becomes `<server path>`."""
    protect = bool(request_path) and "\x00" not in request_path
    if protect:
        message = message.replace(request_path, _OWN)
    for location, label in sorted(replacements.items(), key=lambda kv: -len(kv[0])):
        if location and location not in ("/", "."):
            message = message.replace(location, label)
    own = request_path if request_path.startswith("/") else None

    def keep_or_hide(m: re.Match) -> str:
        text = m.group(0)
        if own is not None and (text == own or text.startswith(own.rstrip("/") + "/")):
            return text
        return "<server path>"

    message = _ABSOLUTE.sub(keep_or_hide, message)
    return message.replace(_OWN, request_path) if protect else message


# ---------------------------------------------------------------------------------------------- audit
def server_log(level: str, line: str) -> None:
    """To the server log: python logging, and pb_utils.Logger when running inside the Python backend."""
    getattr(LOG, {"warn": "warning"}.get(level, level))(line)
    try:
        import triton_python_backend_utils as pb_utils  # only importable inside the Python-backend stub
    except ImportError:
        return
    logger = pb_utils.Logger
    {"info": logger.log_info, "warn": logger.log_warn, "error": logger.log_error}.get(level, logger.log_info)(line)


class AuditLog:
    """Append-only JSON lines (one `os.write` per line on an O_APPEND descriptor; created 0600)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def write(self, record: dict[str, Any]) -> str:
        line = json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **record}, sort_keys=False,
                          ensure_ascii=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
        return line

    def records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Show or rotate the adapter_admin key of a registry.")
    parser.add_argument("command", choices=("show", "rotate", "headers"))
    parser.add_argument("--registry-root", type=Path, default=Path("artifacts/registry"))
    parser.add_argument("--key-file", type=Path, default=None, help="when adapter_admin's admin_key_file is set")
    args = parser.parse_args(argv)
    path = key_file_path(args.registry_root, args.key_file)
    try:
        if args.command == "rotate":
            rotate_admin_key(path)
            print(f"rotated the admin key in {path}; clients need the new one from now on", file=sys.stderr)
            return 0
        key = read_admin_key(path)
    except AdminKeyError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(json.dumps({ADMIN_KEY_HEADER: key}) if args.command == "headers" else key)
    return 0


if __name__ == "__main__":
    sys.exit(main())
