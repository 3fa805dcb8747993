"""The record of a running server, kept in ``<pid_file>.json`` next to the PID file, and the clean-up after a server
that died without being stopped (SIGKILL, a Signal 11 crash, a launcher that was killed itself).

What is recorded, and when (:class:`ServerRecord`):

* at start: the server's PID (it leads its own process group, so it is the PGID too), its start time in clock ticks
  since boot (a PID alone is no identity: PIDs are reused), the boot id, the wall-clock start time, the ports and the
  command (what :meth:`TritonServer.describe` gives), the log file and the byte offset where this run's part starts;
* on every readiness poll, right after ready and again at stop (:meth:`ServerRecord.observe`): every
  ``triton_python_backend_stub`` seen in the server's process group (PID, start ticks, region, model file) and every
  ``/dev/shm/triton_python_backend_shm_region*`` file the group maps or a stub names; stubs that have exited and
  regions that no longer exist are dropped. The file is rewritten (atomically) only when it changed.

:func:`clean_up_after` is what the next start in the same work dir (and ``scripts/tritonserver.py start/stop``) runs
when the record names a server that is gone, or a PID that is not that tritonserver any more: it SIGKILLs what is left
of the dead server's process group (only when no other process has taken the group's PID since) and the recorded stubs
that still are those very stub processes, then unlinks the recorded regions, the regions those processes named or
mapped, and the regions a verbose log named, each only when no live process still uses it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from tritonserver_backend.launcher.logs import logged_shm_regions
from tritonserver_backend.launcher.process import (
    boot_id,
    group_members,
    group_shm_regions,
    is_python_stub,
    is_tritonserver,
    kill_leftovers,
    kill_pids,
    pid_alive,
    proc_argv,
    proc_info,
    region_path,
    same_process,
    stub_region,
    unlink_unused_regions,
)


@dataclasses.dataclass
class StubSeen:
    """A Python-backend stub seen in the server's process group."""

    pid: int
    start_ticks: int | None
    region: str | None = None
    model: str | None = None


@dataclasses.dataclass
class ServerRecord:
    """What the launcher knows about a server it started; see the module docstring for when each field is written.

    ``info`` holds the rest of the JSON file as it is (ports, binary, command: :meth:`TritonServer.describe`); the
    file is flat, so readers that only want the ports keep working."""

    pid: int
    pgid: int | None = None
    start_ticks: int | None = None
    boot_id: str | None = None
    started_at: float | None = None
    log_file: str | None = None
    log_offset: int = 0
    stubs: list[StubSeen] = dataclasses.field(default_factory=list)
    shm_regions: list[str] = dataclasses.field(default_factory=list)
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:  # the recorded fields win over the same keys in ``info`` (pid, log_file)
        own = {f.name for f in dataclasses.fields(self)}
        self.info = {k: v for k, v in self.info.items() if k not in own}

    @classmethod
    def for_process(cls, pid: int, info: dict[str, Any] | None = None, log_file: Path | str | None = None,
                    log_offset: int = 0) -> "ServerRecord":
        """The record of the server just started as ``pid`` (read its start time now, while it surely runs)."""
        proc = proc_info(pid)
        return cls(pid=pid, pgid=pid, start_ticks=proc.start_ticks if proc else None, boot_id=boot_id(),
                   started_at=time.time(), log_file=str(log_file) if log_file else None, log_offset=log_offset,
                   info=dict(info or {}))

    # -- JSON ---------------------------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        data = dict(self.info)
        data.update(
            pid=self.pid,
            pgid=self.pgid,
            start_ticks=self.start_ticks,
            boot_id=self.boot_id,
            started_at=self.started_at,
            log_file=self.log_file,
            log_offset=self.log_offset,
            stubs=[dataclasses.asdict(s) for s in self.stubs],
            shm_regions=list(self.shm_regions),
        )
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ServerRecord":
        stubs = []
        for s in data.get("stubs") or []:
            if isinstance(s, dict) and isinstance(s.get("pid"), int):
                stubs.append(StubSeen(pid=s["pid"], start_ticks=_int_or_none(s.get("start_ticks")),
                                      region=s.get("region"), model=s.get("model")))
        return cls(
            pid=int(data["pid"]),
            pgid=_int_or_none(data.get("pgid")),
            start_ticks=_int_or_none(data.get("start_ticks")),
            boot_id=data.get("boot_id"),
            started_at=data.get("started_at"),
            log_file=data.get("log_file"),
            log_offset=_int_or_none(data.get("log_offset")) or 0,
            stubs=stubs,
            shm_regions=[str(r) for r in data.get("shm_regions") or []],
            info=data,
        )

    # -- the live server ----------------------------------------------------------------------------------------------
    def same_boot(self) -> bool:
        """Whether the record was written during this boot (unknown counts as yes)."""
        now = boot_id()
        return self.boot_id is None or now is None or now == self.boot_id

    def server_alive(self) -> bool:
        """Whether the recorded server still runs: its PID is alive, started when recorded, and runs tritonserver."""
        return self.same_boot() and same_process(self.pid, self.start_ticks) and is_tritonserver(self.pid)

    def observe(self) -> bool:
        """Add the stubs and regions the running server's process group has now, and forget stubs that have exited
        (the stubs that check a model's config come and go while it loads) and regions that no longer exist; returns
        whether the record changed. A region that outlived its stub stays: that is the leak to clean up later."""
        if not self.server_alive():
            return False
        members = [self.pid, *[m for m in group_members(self.pgid or self.pid) if m != self.pid]]
        live = [s for s in self.stubs if same_process(s.pid, s.start_ticks)]
        changed = len(live) != len(self.stubs)
        self.stubs = live
        known = {(s.pid, s.start_ticks) for s in self.stubs}
        for pid in members[1:]:
            argv = proc_argv(pid)
            info = proc_info(pid)
            if info is None or not is_python_stub(pid) or (pid, info.start_ticks) in known:
                continue
            region = stub_region(argv)
            self.stubs.append(StubSeen(pid=pid, start_ticks=info.start_ticks, region=str(region) if region else None,
                                       model=argv[1] if len(argv) > 1 else None))
            changed = True
        regions = {r for r in self.shm_regions if region_path(r).exists()}
        regions |= {str(r) for r in group_shm_regions(members)}
        if regions != set(self.shm_regions):
            self.shm_regions = sorted(regions)
            changed = True
        return changed

    def regions(self) -> set[Path]:
        """Every region recorded, directly or as a stub's."""
        return {region_path(r) for r in self.shm_regions} | {region_path(s.region) for s in self.stubs if s.region}


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# -- the files -------------------------------------------------------------------------------------------------------
def record_path(pid_file: Path | str) -> Path:
    """``<pid_file>.json``."""
    pid_file = Path(pid_file)
    return pid_file.with_name(pid_file.name + ".json")


def _read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def read_record(pid_file: Path | str) -> ServerRecord | None:
    """The record next to ``pid_file``; a bare PID file (no JSON, or a JSON naming another PID) gives a record with
    the PID only. None when there is neither."""
    pid_file = Path(pid_file)
    pid = _read_pid(pid_file)
    try:
        data = json.loads(record_path(pid_file).read_text())
    except (FileNotFoundError, ValueError):
        data = None
    if isinstance(data, dict) and isinstance(data.get("pid"), int) and pid in (None, data["pid"]):
        return ServerRecord.from_json(data)
    return ServerRecord(pid=pid) if pid is not None else None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_record(pid_file: Path | str, record: ServerRecord) -> None:
    """Write the PID file and the JSON record next to it (each atomically)."""
    pid_file = Path(pid_file)
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(pid_file, f"{record.pid}\n")
    _write_atomic(record_path(pid_file), json.dumps(record.to_json(), indent=2) + "\n")


def remove_record(pid_file: Path | str, pid: int | None = None) -> bool:
    """Remove the PID file and its JSON record; with ``pid``, only when the PID file still names that PID."""
    pid_file = Path(pid_file)
    if pid is not None and _read_pid(pid_file) != pid:
        return False
    pid_file.unlink(missing_ok=True)
    record_path(pid_file).unlink(missing_ok=True)
    return True


# -- the clean-up ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Cleanup:
    """What :func:`clean_up_after` did after the server ``pid``."""

    pid: int
    killed: list[int] = dataclasses.field(default_factory=list)
    unlinked: list[Path] = dataclasses.field(default_factory=list)
    in_use: list[Path] = dataclasses.field(default_factory=list)  # recorded regions a live process still uses
    not_ours: list[int] = dataclasses.field(default_factory=list)  # recorded PIDs now held by other processes

    @property
    def did_something(self) -> bool:
        return bool(self.killed or self.unlinked)

    def summary(self) -> str:
        parts = []
        if self.killed:
            parts.append("killed left-over PIDs " + ", ".join(map(str, self.killed)))
        if self.unlinked:
            parts.append(f"unlinked {len(self.unlinked)} shm region(s) " + ", ".join(p.name for p in self.unlinked))
        if not parts:
            parts.append("nothing was left behind")
        if self.in_use:
            parts.append(f"left {len(self.in_use)} region(s) alone that live processes still use")
        if self.not_ours:
            parts.append("left PIDs " + ", ".join(map(str, self.not_ours)) + " alone (other processes now)")
        return f"after tritonserver PID {self.pid}: " + "; ".join(parts)


def _group_left_by(record: ServerRecord) -> int | None:
    """The dead server's process group when it can only hold what that server left behind, else None.

    Linux does not give a PID to a new process while a process group of that id has members; so when no live process
    has the group's PID, every member is a descendant of the dead leader (a session of its own: nobody else could
    join). When the PID is alive again it is another process, and so is the group. (Only if the server's group had
    emptied and its PID had then led another session that died in turn could the members be that session's orphans:
    processes whose leader is gone either way.)"""
    if not record.same_boot():
        return None
    pgid = record.pgid or record.pid
    leader = proc_info(pgid)
    if leader is None or not leader.alive:
        return pgid
    return None


def clean_up_after(record: ServerRecord, wait: float = 10.0) -> Cleanup:
    """Clean up after the recorded server, which must not run any more (raises RuntimeError when it still does).

    SIGKILLs what is left in its process group (see :func:`_group_left_by`) and the recorded stubs that are still the
    same ``triton_python_backend_stub`` processes (same PID and start time; a stub recorded without a start time is
    never killed by PID), then unlinks the regions recorded, named or mapped by those processes, or named in this
    run's (verbose) log, that no live process uses. A recorded PID that now belongs to another process is left alone
    and reported in ``not_ours``."""
    if record.server_alive():
        raise RuntimeError(f"tritonserver PID {record.pid} still runs; stop it instead of cleaning up after it")
    done = Cleanup(pid=record.pid)
    regions = record.regions() | {region_path(r) for r in logged_shm_regions(record.log_file, record.log_offset)}
    pgid = _group_left_by(record)
    if pgid is not None:
        regions |= group_shm_regions(group_members(pgid))
        done.killed += kill_leftovers(pgid, wait)
    elif pid_alive(record.pid):  # the server is not alive, so whatever has its PID now is another process
        done.not_ours.append(record.pid)
    if record.same_boot():
        for stub in record.stubs:
            info = proc_info(stub.pid)
            if info is None or not info.alive or stub.pid in done.killed:
                continue
            if is_python_stub(stub.pid) and stub.start_ticks is not None and stub.start_ticks == info.start_ticks:
                regions |= group_shm_regions([stub.pid])
                done.killed += kill_pids([stub.pid], wait)
            else:
                done.not_ours.append(stub.pid)
    done.unlinked, done.in_use = unlink_unused_regions(regions)
    return done
