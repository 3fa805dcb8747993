"""Fetch pinned archives from the three registries into a cache directory, using each registry's own client.

Why the clients and not HTTP: the registries are the only network this project may reach, and `pip download`,
`apt-get download` and `npm pack` resolve mirrors, proxies and authentication the way the machine is set up.
Why sha256 gates everything: a cached archive whose hash matches its pin is reused without running any command,
so a re-run is offline and cheap; a fresh download whose hash differs from the pin is refused, so the corpora never
silently change underneath a trained model.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from build_engines.data.corpora.errors import DownloadError
from build_engines.data.corpora.pins import Pin

Log = Callable[[str], None]
COMMAND_TIMEOUT_S = 900


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_command(pin: Pin, dest: Path) -> list[str]:
    """The client command that saves `pin` into `dest` (it runs with `dest` as working directory: apt-get needs it)."""
    if pin.registry == "pypi":
        # Ask for the same artifact type as the pin, so pip never swaps a wheel for an sdist or back.
        kind = "--only-binary=:all:" if pin.filename.endswith(".whl") else "--no-binary=:all:"
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "--retries", "1", "--timeout", "60", kind, "-d", str(dest), pin.spec]
    elif pin.registry == "debian":
        command = ["apt-get", "download", "-o", "Acquire::Retries=1", pin.spec]
    elif pin.registry == "npm":
        command = ["npm", "pack", pin.spec, "--pack-destination", str(dest), "--fetch-retries=1", "--loglevel=error"]
    else:  # pragma: no cover - Pin.registry is a Literal
        raise DownloadError(f"unknown registry {pin.registry!r} for {pin.package}")
    return command


_ERROR_LINE = re.compile(r"^(E:|ERROR|npm error|npm ERR!)")
# npm prints a stack, error codes and a log-file pointer around the one line that says what went wrong.
_NPM_NOISE = re.compile(r"^npm (error|ERR!)( *$|  | (code|syscall|errno|A complete log|If you are behind)\b|"
                        r" [{}]| \w+: ')")
_NETWORK = re.compile(r"Connection refused|NewConnectionError|Temporary failure in name resolution|"
                      r"ECONNREFUSED|ENOTFOUND|ETIMEDOUT|timed out|Could not resolve|Failed to fetch", re.I)


def failure_summary(output: str) -> str:
    """The one line of a registry client's output that says why it failed (plus a note if the network is down)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.match(line) and not _NPM_NOISE.match(line)]
    if not errors:
        summary = lines[-1] if lines else "no output"
    elif errors[0].startswith("npm"):
        summary = errors[0]  # npm's first message line is the reason, the rest is detail
    else:
        summary = errors[-1]  # pip and apt end with their conclusion
    if _NETWORK.search(output) and not _NETWORK.search(summary):
        summary += " (the registry looks unreachable)"
    return summary


def _hint(pin: Pin) -> str:
    if pin.registry == "debian":
        return "; run `apt-get update` first, and if the pinned revision left the archive update it in " \
               "build_engines/corpora/pins.py"
    return ""


def run_command(command: Sequence[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run one registry client; kept separate so tests can forbid downloads by replacing it."""
    return subprocess.run(list(command), cwd=cwd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                          check=False)


def fetch(pin: Pin, cache_dir: Path, log: Log) -> Path:
    """Path of the pinned archive in `cache_dir/<registry>/`, downloading it only when absent or wrong."""
    target = cache_dir / pin.registry / pin.filename
    label = f"{pin.registry} {pin.spec}"
    if target.is_file():
        if sha256_file(target) == pin.sha256:
            log(f"cached      {label}")
            return target
        log(f"sha256 of cached {target} differs from its pin: downloading it again")
        target.unlink()

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".download-", dir=target.parent)).resolve()
    try:
        command = download_command(pin, staging)
        shown = " ".join(command[2:] if command[0] == sys.executable else command)
        log(f"downloading {label}")
        try:
            result = run_command(command, staging)
        except FileNotFoundError:
            raise DownloadError(f"cannot download {label}: `{command[0]}` is not installed") from None
        except subprocess.TimeoutExpired:
            raise DownloadError(f"cannot download {label}: `{shown}` timed out after {COMMAND_TIMEOUT_S} s "
                                f"(registry unreachable?)") from None
        if result.returncode != 0:
            raise DownloadError(f"cannot download {label}: `{shown}` failed: "
                                f"{failure_summary(result.stderr + result.stdout)}{_hint(pin)}")
        saved = sorted(p for p in staging.iterdir() if p.is_file())
        if len(saved) != 1:
            raise DownloadError(f"`{shown}` saved {len(saved)} files ({[p.name for p in saved]}), expected one")
        got = sha256_file(saved[0])
        if got != pin.sha256:
            raise DownloadError(f"{label}: the registry served {saved[0].name} with sha256 {got}, the pin says "
                                f"{pin.sha256}; refusing it (update build_engines/corpora/pins.py if intended)")
        os.replace(saved[0], target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
