"""The workers' Dynamo runtime takes its transports from the same DYN_* variables as the frontend (fast; no Dynamo)."""

from __future__ import annotations

import pytest
import yaml

from dynamo_deploy.worker_common import RUNTIME_CHOICES, discovery_env, runtime_transports
from tests.tiny import PROJECT_ROOT

GRAPH = PROJECT_ROOT / "deploy" / "dynamo" / "graph.yaml"


def test_unset_variables_give_the_loopback_transports() -> None:
    assert runtime_transports({}) == ("file", "tcp", "zmq")
    assert runtime_transports({"DYN_DISCOVERY_BACKEND": ""}) == ("file", "tcp", "zmq")


def test_each_variable_is_honoured() -> None:
    env = {"DYN_DISCOVERY_BACKEND": "etcd", "DYN_REQUEST_PLANE": "nats", "DYN_EVENT_PLANE": "nats"}
    assert runtime_transports(env) == ("etcd", "nats", "nats")
    assert runtime_transports({"DYN_DISCOVERY_BACKEND": "kubernetes"}) == ("kubernetes", "tcp", "zmq")
    for name, choices in RUNTIME_CHOICES.items():
        for value in choices:
            assert value in runtime_transports({name: value})


@pytest.mark.parametrize("name", sorted(RUNTIME_CHOICES))
def test_an_unknown_transport_is_refused_by_name(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name}='carrier-pigeon' is not one of"):
        runtime_transports({name: "carrier-pigeon"})


def test_the_loopback_environment_and_the_graph_agree_with_the_frontend_flags(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The launcher's environment and the operator graph's envs give the workers the transports the frontend's
    command line names."""
    assert runtime_transports(discovery_env(tmp_path)) == ("file", "tcp", "zmq")
    graph = yaml.safe_load(GRAPH.read_text())
    env = {e["name"]: e["value"] for e in graph["spec"]["envs"] if "value" in e}
    frontend = next(s for s in graph["spec"]["services"].values() if s["componentType"] == "frontend")
    args = frontend["extraPodSpec"]["mainContainer"]["args"]
    flags = {args[i]: args[i + 1] for i in range(len(args) - 1) if str(args[i]).startswith("--")}
    assert runtime_transports(env) == (flags["--discovery-backend"], flags["--request-plane"], flags["--event-plane"])
