"""Shared fixtures: a replayable random seed per test, a tiny network drawn with it, and (session-wide, made on first
use) the embedded default's engines and the prepared corpora."""

from __future__ import annotations

import json
import os
import random
import zlib
from pathlib import Path

import pytest
import torch
from _pytest.nodeid import NodeId

from ced.model.network import CEDNetwork
from tests.tiny import PROJECT_ROOT, tiny_network

EMBEDDED = PROJECT_ROOT / "embedded" / "mol2-small"
DEFAULT_ENGINES = PROJECT_ROOT / "artifacts" / "engines" / "mol2-small"


PLAIN_NODE_ID = pytest.StashKey[str]()  # a test's node id before the "@group" suffix of a grouped run
GROUP_DURATIONS = Path(__file__).resolve().parent / "group_durations.json"  # scripts/test_durations.py --write-groups
UNKNOWN_GROUP_S = 20.0  # a group the durations file does not know yet is scheduled as if it took this long
WORKER_PORTS = 3000  # each xdist worker's own slice of loopback ports (MOL2_PORT_RANGE, ced/ports.py), from 20000
GROUPS_OUT = "MOL2_GROUPS_OUT"  # a folder: each worker writes which group each of its tests ran in (test_durations)


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker takes its own range of ports before anything asks for one, so two workers starting servers
    side by side never pick the same port (ced/ports.py); the processes it starts inherit the range."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and not os.environ.get("MOL2_PORT_RANGE"):
        first = 20000 + int(worker[2:]) * WORKER_PORTS
        os.environ["MOL2_PORT_RANGE"] = f"{first}-{first + WORKER_PORTS - 1}"


def shared_fixture_package(item: pytest.Item) -> str | None:
    """The package whose conftest gives `item` a package- or session-scoped fixture (a shared server, the exported
    graphs), if any; the root conftest's (the default engines, the corpora: built once, behind a lock) do not count."""
    for name in item.fixturenames:
        for fixture in item._fixtureinfo.name2fixturedefs.get(name, ()):
            if fixture.scope in ("package", "session") and fixture.baseid not in ("", "tests"):
                return fixture.baseid
    return None


def server_groups(items: list[pytest.Item]) -> dict[str, str]:
    """Each test's group, the unit a worker takes whole: the Dynamo deployments (one worker runs them all, one after
    the other); else, for a module any of whose tests uses a shared fixture of its package, that package (the
    fixture starts or builds once, in the one worker that holds all its users); else the test's module (its
    module-scoped servers start once)."""
    modules: dict[str, str] = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        if path.startswith("tests/dynamo_deploy/") or path == "tests/deploy/test_dynamo_graph.py":
            modules[path] = "dynamo"
        elif modules.get(path, path) == path:
            modules[path] = shared_fixture_package(item) or path
    return {item.nodeid: modules[item.nodeid.split("::")[0]] for item in items}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `--dist loadgroup` (scripts/test.sh), every test gets its group (`server_groups`) and the groups are
    ordered longest first by tests/group_durations.json (what the last recorded run measured), so that the long groups
    start at once and the short ones fill in at the end instead of leaving one worker alone with a long tail."""
    # the controller has dist=loadgroup; xdist's workers, which collect, have dist=no and loadgroup=True
    if not (getattr(config.option, "loadgroup", False) or config.getoption("dist", default="no") == "loadgroup"):
        return
    groups = server_groups(items)
    for item in items:
        # xdist's loadgroup unit is the text after "@" in a node id. Its own hook, which appends what an xdist_group
        # mark names, sets `_nodeid`, which pytest 9.2 no longer reads (node ids are NodeId objects in `_id`): so the
        # id is set here, and the id the test had is kept for what must not depend on the run's mode (its seed)
        item.stash[PLAIN_NODE_ID] = item.nodeid
        item._id = NodeId.parse(f"{item.nodeid}@{groups[item.nodeid]}")
    seconds = json.loads(GROUP_DURATIONS.read_text()) if GROUP_DURATIONS.exists() else {}
    items.sort(key=lambda item: -seconds.get(groups[item.stash[PLAIN_NODE_ID]], UNKNOWN_GROUP_S))  # stable sort
    out = os.environ.get(GROUPS_OUT, "")
    if out:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"groups-{worker}.json").write_text(json.dumps(groups, indent=0))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--seed", default=None,
                     help="the `seed` fixture's value for every test: an integer replays a failure; 'random' draws a "
                          "fresh one per test (printed); default: a fixed seed per test, derived from its id")


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """The test's random seed: by default fixed per test (CRC-32 of its id), so a run never fails by chance and a
    failure replays as it is; `--seed N` replays a given one, `--seed random` explores new inputs. Printed either way
    (pytest shows it with a failure's captured output)."""
    chosen = request.config.getoption("--seed")
    if chosen == "random":
        value = random.SystemRandom().randrange(2**31)
    elif chosen is not None:
        value = int(chosen)
    else:
        value = zlib.crc32(request.node.stash.get(PLAIN_NODE_ID, request.node.nodeid).encode()) & 0x7FFFFFFF
    print(f"random seed: {value} (replay with --seed {value})")
    torch.manual_seed(value)
    return value


@pytest.fixture
def net(seed: int) -> CEDNetwork:
    return tiny_network()


@pytest.fixture(scope="session")
def default_engines():  # type: ignore[no-untyped-def]
    """The embedded default's ONNX engines, built (about a minute) or reused when current, as `scripts/main.sh` does."""
    from build_engines.build.cli import main as build

    code = build(["--model", str(EMBEDDED), "--out", str(DEFAULT_ENGINES)])
    assert code == 0, f"python -m build_engines build exited {code}"
    return DEFAULT_ENGINES


@pytest.fixture(scope="session")
def real_data():  # type: ignore[no-untyped-def]
    """The real corpora in artifacts/data, prepared (about 25 s from the download cache, 1.5 min without) or reused
    when current (tests/real_data.py), for the checks of the shipped settings on real text."""
    from tests.real_data import ensure_real_data

    return ensure_real_data()
