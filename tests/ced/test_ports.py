"""Free ports: with MOL2_PORT_RANGE every port comes from the range, none twice in a row of the range, a bound one is
skipped; a malformed range fails by name."""

from __future__ import annotations

import socket

import pytest

from ced import ports


@pytest.fixture
def fresh_cursors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_cursors", {})


def test_ports_come_from_the_range_and_never_repeat_within_it(monkeypatch, fresh_cursors) -> None:
    monkeypatch.setenv(ports.RANGE_VARIABLE, "40100-40139")
    picked = [ports.free_port() for _ in range(30)]
    assert all(40100 <= p <= 40139 for p in picked)
    assert len(set(picked)) == len(picked)


def test_a_bound_port_is_skipped(monkeypatch, fresh_cursors) -> None:
    monkeypatch.setenv(ports.RANGE_VARIABLE, "40140-40141")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind((ports.HOST, 40140))
        held.listen()
        assert {ports.free_port() for _ in range(4)} == {40141}


def test_a_range_with_nothing_free_says_so(monkeypatch, fresh_cursors) -> None:
    monkeypatch.setenv(ports.RANGE_VARIABLE, "40142-40142")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind((ports.HOST, 40142))
        held.listen()
        with pytest.raises(OSError, match="no free port left in MOL2_PORT_RANGE=40142-40142"):
            ports.free_port()


@pytest.mark.parametrize("value", ["40000", "b-c", "30000-20000", "80-90", "1024-70000"])
def test_a_malformed_range_fails_naming_the_variable(monkeypatch, fresh_cursors, value: str) -> None:
    monkeypatch.setenv(ports.RANGE_VARIABLE, value)
    with pytest.raises(ValueError, match="MOL2_PORT_RANGE"):
        ports.free_port()


def test_without_a_range_the_kernel_picks_a_bindable_port(monkeypatch, fresh_cursors) -> None:
    monkeypatch.delenv(ports.RANGE_VARIABLE, raising=False)
    port = ports.free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ports.HOST, port))
