"""The server's processes: liveness and identity read from /proc, its process group, stopping it, and the Python
backend's shared-memory regions in /dev/shm.

The server runs in a session of its own (``start_new_session=True``), so it leads a process group (pgid = its pid)
that holds it and every ``triton_python_backend_stub`` it spawns (~0.5 GB each). Each stub attaches to a region
``/dev/shm/triton_python_backend_shm_region_<uuid>`` that the server created (its name is the stub's third argv
word). When the server dies a stub notices within ~300 ms, exits and unlinks its region; a stub that is wedged (or
stopped) does not notice and lives on, and a stub killed together with the server leaves its region behind for good
(tmpfs memory nobody frees). :func:`stop_pid` therefore ends the whole group and unlinks the regions the group had
mapped; :mod:`.record` does the same after a server that died on its own.

Never kill or unlink what is not ours:

* a pid is only trusted with its start time (field 22 of /proc/PID/stat, clock ticks since boot): pids are reused;
* a process group whose leader pid is gone holds only what that leader left behind: Linux does not hand out a pid
  while a process group (or session) of that id still has members, so group ``pgid`` with no live process ``pgid``
  is the dead leader's group; when process ``pgid`` exists but is another process, the group is not ours;
* a region is unlinked only when it is a ``/dev/shm/triton_python_backend_shm_region*`` file that no live process
  maps, holds open, or is a stub about to attach to (:func:`regions_in_use`).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterable, Iterator

from tritonserver_backend.launcher.install import STUB_NAME

SHM_DIR = Path("/dev/shm")
SHM_REGION_NAME = "triton_python_backend_shm_region"
SHM_REGION_PREFIX = f"{SHM_DIR}/{SHM_REGION_NAME}"
_GONE = ("Z", "X")  # zombie / dead: the process has exited (and released its memory), only its entry is left


@dataclasses.dataclass(frozen=True)
class ProcInfo:
    """One process as /proc/PID/stat shows it."""

    pid: int
    state: str  # one letter: R, S, D, T (stopped), Z (zombie), ...
    ppid: int
    pgid: int
    start_ticks: int  # when it started, in clock ticks since boot: with the pid, the process's identity

    @property
    def alive(self) -> bool:
        return self.state not in _GONE


def proc_info(pid: int) -> ProcInfo | None:
    """``pid`` as /proc shows it (None when there is no such process)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()  # after "pid (comm)"; comm may hold spaces and parentheses
        return ProcInfo(pid=pid, state=fields[0], ppid=int(fields[1]), pgid=int(fields[2]),
                        start_ticks=int(fields[19]))
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def _proc_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` from /proc (None when there is no such process)."""
    info = proc_info(pid)
    return None if info is None else info.state


def _pids() -> Iterator[int]:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            yield int(entry)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an exited child not yet reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _proc_state(pid) not in (None, *_GONE)


def same_process(pid: int, start_ticks: int | None) -> bool:
    """Whether ``pid`` is alive and is the process that started at ``start_ticks`` (any process when None)."""
    info = proc_info(pid)
    return info is not None and info.alive and (start_ticks is None or info.start_ticks == start_ticks)


def boot_id() -> str | None:
    """This boot's id (pids and start times from another boot mean nothing now)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def proc_argv(pid: int) -> list[str]:
    """The command line of ``pid`` ([] when it is gone or a kernel thread)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            raw = fh.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []
    if not raw:
        return []
    return [word.decode(errors="replace") for word in raw.removesuffix(b"\0").split(b"\0")]


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid`` (from /proc)."""
    members = []
    for pid in _pids():
        info = proc_info(pid)
        if info is not None and info.pgid == pgid and info.alive:
            members.append(pid)
    return members


def _group_left_behind(pgid: int) -> bool:
    """Whether process group ``pgid`` can only hold what its dead leader left behind: no live process ``pgid`` now."""
    info = proc_info(pgid)
    return info is None or not info.alive


def is_tritonserver(pid: int) -> bool:
    """Whether ``pid`` runs a ``tritonserver`` binary (guards against a PID file pointing at a reused PID)."""
    argv = proc_argv(pid)
    return bool(argv) and Path(argv[0]).name == "tritonserver"


def is_python_stub(pid: int) -> bool:
    """Whether ``pid`` runs a Python-backend stub (``triton_python_backend_stub``)."""
    argv = proc_argv(pid)
    return bool(argv) and Path(argv[0]).name == STUB_NAME


def _signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group led by ``pid`` (the server and its stubs), or to ``pid`` alone."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
            return
    except ProcessLookupError:
        return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait_gone(pids: Iterable[int], wait: float) -> None:
    pending = list(pids)
    deadline = time.monotonic() + wait
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        pending = [pid for pid in pending if pid_alive(pid)]


def kill_pids(pids: Iterable[int], wait: float = 10.0) -> list[int]:
    """SIGKILL ``pids`` (check first that they are yours) and wait until they are gone; returns those signalled."""
    killed = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    _wait_gone(killed, wait)
    return killed


def kill_leftovers(pgid: int, wait: float = 10.0) -> list[int]:
    """SIGKILL whatever is still alive in the server's process group (orphaned Python-backend stubs), and wait
    until the group is really empty: a killed process lingers a moment before the kernel removes it. Returns the
    PIDs that were signalled."""
    killed: list[int] = []
    deadline = time.monotonic() + wait
    while True:
        members = group_members(pgid)
        if not members or time.monotonic() > deadline:
            return killed
        for member in members:
            try:
                os.kill(member, signal.SIGKILL)
                if member not in killed:
                    killed.append(member)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def stop_pid(
    pid: int,
    grace: float = 20.0,
    popen: subprocess.Popen | None = None,
    regions: Iterable[Path | str] = (),
) -> str:
    """Stop the server ``pid``: SIGTERM to its process group, wait ``grace`` s, then SIGKILL; returns what happened.

    Returns ``"not running"``, ``"terminated"`` or ``"killed"``. Stub processes left in the group after the server
    ended are killed too, and Python-backend shared-memory regions (``/dev/shm/triton_python_backend_shm_region_*``)
    that the group had mapped and that a killed process left behind are unlinked. ``regions`` adds regions recorded
    earlier (a stub that already died and left its region); no region that a live process still uses is unlinked.
    When the server is already gone, its group is only cleared if no other process has taken its PID since.
    """

    def alive() -> bool:
        return popen.poll() is None if popen is not None else pid_alive(pid)

    wanted = {Path(r) for r in regions}
    if not alive():
        if _group_left_behind(pid):
            wanted |= group_shm_regions(group_members(pid))
            kill_leftovers(pid)
        unlink_unused_regions(wanted)
        return "not running"
    wanted |= group_shm_regions([pid, *group_members(pid)])
    _signal_group(pid, signal.SIGTERM)
    outcome = "terminated"
    deadline = time.monotonic() + grace
    while alive() and time.monotonic() < deadline:
        if popen is not None:
            try:
                popen.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
        else:
            time.sleep(0.1)
    if alive():
        wanted |= group_shm_regions([pid, *group_members(pid)])
        _signal_group(pid, signal.SIGKILL)
        outcome = "killed"
        if popen is not None:
            popen.wait(timeout=10)
        else:
            deadline = time.monotonic() + 10
            while alive() and time.monotonic() < deadline:
                time.sleep(0.05)
    wanted |= group_shm_regions(group_members(pid))  # stubs that outlived the server, about to be killed
    kill_leftovers(pid)
    unlink_unused_regions(wanted)
    return outcome


# -- shared-memory regions -------------------------------------------------------------------------------------------
def is_shm_region(path: Path | str) -> bool:
    """Whether ``path`` names a Python-backend region (nothing else, in /dev/shm or elsewhere, is ever unlinked)."""
    path = Path(path)
    return path.parent == SHM_DIR and path.name.startswith(SHM_REGION_NAME) and path.name not in ("", ".", "..")


def region_path(region: Path | str) -> Path:
    """A region's path from its name (as on a stub's command line) or its path."""
    text = str(region)
    return Path(text) if "/" in text else SHM_DIR / text


def mapped_shm_regions(pids: Iterable[int]) -> set[Path]:
    """Python-backend shared-memory files mapped by ``pids`` (read from /proc/PID/maps)."""
    found: set[Path] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith(SHM_REGION_PREFIX):
                        found.add(Path(fields[5].rstrip("\n").removesuffix(" (deleted)")))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def stub_region(argv: list[str]) -> Path | None:
    """The region a stub's command line names (``triton_python_backend_stub MODEL.py REGION ...``), if any."""
    if not argv or Path(argv[0]).name != STUB_NAME:
        return None
    for word in argv[1:]:
        if word.startswith(SHM_REGION_NAME):
            return SHM_DIR / word
    return None


def stub_instance_name(argv: list[str]) -> str | None:
    """The instance a stub serves, from its command line (``triton_python_backend_stub MODEL.py REGION SIZE GROWTH
    PARENT_PID LIB_DIR IPC_HANDLE NAME RUNTIME``, the Python backend of Triton 2.51): ``<model>_<group>_<index>`` for
    a model instance, the bare model name for the short-lived stub that completes a model's config while it loads."""
    if len(argv) < 9 or Path(argv[0]).name != STUB_NAME or not argv[2].startswith(SHM_REGION_NAME):
        return None
    return argv[8]


def group_shm_regions(pids: Iterable[int]) -> set[Path]:
    """Regions that ``pids`` map, plus the regions named on the command lines of the stubs among them (a stub names
    its region before it has mapped it)."""
    pids = list(pids)
    found = mapped_shm_regions(pids)
    for pid in pids:
        region = stub_region(proc_argv(pid))
        if region is not None:
            found.add(region)
    return found


def _open_shm_regions(pid: int) -> set[Path]:
    found: set[Path] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(SHM_REGION_PREFIX):
            found.add(Path(target.removesuffix(" (deleted)")))
    return found


def regions_in_use(regions: Iterable[Path | str]) -> set[Path]:
    """Which of ``regions`` some live process still uses: maps it, holds it open, or is a stub named to attach to it.

    Every process this user may inspect is looked at (another user's processes cannot be read and do not count)."""
    wanted = {region_path(r) for r in regions}
    used: set[Path] = set()
    if not wanted:
        return used
    for pid in _pids():
        info = proc_info(pid)
        if info is None or not info.alive:
            continue
        used |= (mapped_shm_regions([pid]) | _open_shm_regions(pid)) & wanted
        region = stub_region(proc_argv(pid))
        if region in wanted:
            used.add(region)
        if used == wanted:
            break
    return used


def unlink_unused_regions(regions: Iterable[Path | str]) -> tuple[list[Path], list[Path]]:
    """Unlink the Python-backend regions among ``regions`` that still exist and that no live process uses.

    Returns ``(unlinked, in_use)``: the regions removed, and the existing ones left alone because a live process
    still uses them. Paths that are not Python-backend regions in /dev/shm are ignored."""
    candidates = sorted({p for p in map(region_path, regions) if is_shm_region(p) and p.exists()})
    if not candidates:
        return [], []
    in_use = regions_in_use(candidates)
    unlinked = []
    for region in candidates:
        if region in in_use:
            continue
        try:
            region.unlink()
            unlinked.append(region)
        except (FileNotFoundError, PermissionError):
            pass
    return unlinked, sorted(in_use)
