"""Shared fixtures: a replayable random seed per test, a tiny network drawn with it, and (session-wide, made on first
use) the embedded default's engines and the prepared corpora."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from ced.model.network import CEDNetwork
from tests.tiny import PROJECT_ROOT, tiny_network

EMBEDDED = PROJECT_ROOT / "embedded" / "mol2-small"
DEFAULT_ENGINES = PROJECT_ROOT / "artifacts" / "engines" / "mol2-small"


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
        value = zlib.crc32(request.node.nodeid.encode()) & 0x7FFFFFFF
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
