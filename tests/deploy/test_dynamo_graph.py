"""The Dynamo graph (deploy/dynamo/graph.yaml): a DynamoGraphDeployment for NVIDIA Dynamo's operator.

kubernetes-validate has no schema for the operator's CRD, so the graph is checked against the fields of Dynamo's
documented API (nvidia.com/v1alpha1 DynamoGraphDeploymentSpec and DynamoComponentDeploymentSharedSpec, Dynamo
1.x API reference), and every Kubernetes object inside it (containers, init containers, volumes, env, probes) is
validated with the Kubernetes schemas by wrapping it in a Pod. Its command lines are compared with the loopback
launcher's (dynamo_deploy/launcher.py) and parsed by the workers' own argument parser; the slow test runs them here,
on loopback, and holds a conversation through them.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from deploy import layout
from dynamo_deploy.launcher import DYNAMO_PYTHON, Deployment, stop_process
from dynamo_deploy.worker_common import WorkerSettings, discovery_env
from tests.conftest import EMBEDDED
from tests.deploy.checks import (
    DASHBOARD,
    DYNAMO,
    PROMETHEUS,
    dashboard_queries,
    load_yaml_documents,
    parse_promql,
    parse_scrape,
    query_problems,
    scrape_config_added_labels,
    shell_words,
    validation_problems,
)
from tests.tiny import PROJECT_ROOT
from tritonserver_backend.launcher.start_log import START_LOG_ENV, note_start

GRAPH = load_yaml_documents(DYNAMO / "graph.yaml")[0]
RUN_PVC = load_yaml_documents(DYNAMO / "run-pvc.yaml")[0]
# Dynamo 1.x API reference (docs/kubernetes/api_reference.md), nvidia.com/v1alpha1
GRAPH_SPEC_FIELDS = {"pvcs", "services", "envs", "backendFramework"}
SERVICE_FIELDS = {
    "annotations",
    "labels",
    "serviceName",
    "componentType",
    "subComponentType",
    "dynamoNamespace",
    "globalDynamoNamespace",
    "resources",
    "autoscaling",
    "envs",
    "envFromSecret",
    "volumeMounts",
    "ingress",
    "modelRef",
    "sharedMemory",
    "extraPodMetadata",
    "extraPodSpec",
    "livenessProbe",
    "readinessProbe",
    "replicas",
    "multinode",
    "scalingAdapter",
}
COMPONENT_TYPES = {"frontend", "worker", "planner", "main"}
RESOURCE_ITEM_FIELDS = {"cpu", "memory", "gpu", "gpuType", "custom"}
INDEX_EXPR = "\"$(hostname | cksum | cut -d' ' -f1)\""


def graph_problems(graph: dict[str, Any]) -> list[str]:
    """The graph against the documented CRD fields: what the operator's schema would refuse or ignore."""
    problems = []
    if graph.get("apiVersion") != "nvidia.com/v1alpha1" or graph.get("kind") != "DynamoGraphDeployment":
        problems.append(f"not a DynamoGraphDeployment: {graph.get('apiVersion')} {graph.get('kind')}")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", graph.get("metadata", {}).get("name", "")):
        problems.append("metadata.name is not a DNS label")
    spec = graph.get("spec", {})
    problems += [f"spec.{k}: not a field of DynamoGraphDeploymentSpec" for k in set(spec) - GRAPH_SPEC_FIELDS]
    services = spec.get("services", {})
    if not services or len(services) > 25:
        problems.append(f"spec.services: {len(services)} services (1..25)")
    for name, svc in services.items():
        where = f"spec.services.{name}"
        problems += [
            f"{where}.{k}: not a field of DynamoComponentDeploymentSharedSpec" for k in set(svc) - SERVICE_FIELDS
        ]
        if svc.get("componentType") not in COMPONENT_TYPES:
            problems.append(f"{where}.componentType: {svc.get('componentType')!r}")
        if not isinstance(svc.get("replicas"), int) or svc["replicas"] < 0:
            problems.append(f"{where}.replicas: {svc.get('replicas')!r}")
        for part in ("requests", "limits"):
            item = svc.get("resources", {}).get(part, {})
            problems += [
                f"{where}.resources.{part}.{k}: not a ResourceItem field" for k in set(item) - RESOURCE_ITEM_FIELDS
            ]
            problems += [
                f"{where}.resources.{part}.{k}: {v!r} is not a string"
                for k, v in item.items()
                if not isinstance(v, str)
            ]
        if "mainContainer" not in svc.get("extraPodSpec", {}):
            problems.append(f"{where}.extraPodSpec.mainContainer: missing (the image and command of the role)")
    return problems


def as_pod(graph: dict[str, Any], name: str) -> dict[str, Any]:
    """A service as the Pod the operator would make of it (roughly: extraPodSpec, mainContainer as the container,
    the graph's and the service's env, the service's probes), for the Kubernetes schemas."""
    svc = graph["spec"]["services"][name]
    spec = copy.deepcopy(svc["extraPodSpec"])
    main = spec.pop("mainContainer")
    main = {"name": "main", **main}
    main["env"] = graph["spec"].get("envs", []) + svc.get("envs", [])
    for probe in ("livenessProbe", "readinessProbe"):
        if probe in svc:
            main[probe] = svc[probe]
    spec["containers"] = [main]
    labels = svc.get("extraPodMetadata", {}).get("labels", {})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name.lower(), "labels": labels}, "spec": spec}


def _services(role: str) -> list[str]:
    return [n for n, s in GRAPH["spec"]["services"].items() if s["componentType"] == role]


def _worker_argv(name: str, index: str = "7") -> tuple[str, list[str]]:
    """(module, argv) of a worker service's command."""
    main = GRAPH["spec"]["services"][name]["extraPodSpec"]["mainContainer"]
    assert main["command"] == ["/bin/sh", "-c"] and len(main["args"]) == 1
    words = shell_words(main["args"][0].replace(INDEX_EXPR, index))
    assert words[:3] == ["exec", "python", "-m"], words
    return words[3], words[4:]


def _role(name: str) -> str:
    return _worker_argv(name)[0].removeprefix("dynamo_deploy.").removesuffix("_worker")


def test_the_graph_has_the_documented_fields() -> None:
    assert graph_problems(GRAPH) == []
    broken = copy.deepcopy(GRAPH)
    broken["spec"]["services"]["Mol2Decoder"]["replica"] = 2
    broken["spec"]["services"]["Mol2Encoder"]["resources"]["limits"]["gpu"] = 1
    broken["spec"]["services"]["Frontend"]["componentType"] = "gateway"
    assert len(graph_problems(broken)) == 3


def test_frontend_encoder_and_decoder_roles_with_replicas() -> None:
    assert len(_services("frontend")) == 1
    workers = _services("worker")
    roles = sorted(_role(n) for n in workers)
    assert roles == ["decoder", "encoder"]
    for name in workers:
        svc = GRAPH["spec"]["services"][name]
        assert svc["replicas"] >= 2, f"{name}: a role scales by its replicas"
        assert svc["resources"]["requests"]["gpu"] == svc["resources"]["limits"]["gpu"] == "1"


def test_every_kubernetes_object_inside_validates() -> None:
    pods = [as_pod(GRAPH, name) for name in GRAPH["spec"]["services"]]
    assert validation_problems(pods + [RUN_PVC]) == []
    broken = as_pod(GRAPH, "Mol2Decoder")
    broken["spec"]["containers"][0]["volumeMounts"][0]["mountpath"] = "/x"
    assert validation_problems([broken]) != []


def test_mounts_name_the_pods_volumes_and_the_shared_claim() -> None:
    for name, svc in GRAPH["spec"]["services"].items():
        spec = svc["extraPodSpec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        containers = [spec["mainContainer"], *spec.get("initContainers", [])]
        for c in containers:
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{name}/{c.get('name', 'main')}: mounts {m['name']}, not a pod volume"
        assert volumes["run"]["persistentVolumeClaim"]["claimName"] == RUN_PVC["metadata"]["name"]
        assert {m["mountPath"] for m in spec["mainContainer"]["volumeMounts"] if m["name"] == "run"} == {
            str(layout.DYNAMO_RUN)
        }
    assert RUN_PVC["spec"]["accessModes"] == ["ReadWriteMany"]  # every pod of the graph mounts it at once


def test_worker_commands_parse_with_the_workers_own_arguments() -> None:
    for name in _services("worker"):
        module, argv = _worker_argv(name)
        role = _role(name)
        settings = WorkerSettings.from_args(role, argv)  # the workers' real argparse (exits on a bad flag)
        assert module == f"dynamo_deploy.{role}_worker"
        assert str(settings.run_dir) == str(layout.DYNAMO_RUN)
        assert str(settings.registry_root) == str(layout.DYNAMO_RUN / "registry")
        assert str(settings.model_dir) == str(layout.MODEL_DIR) and str(settings.engine_dir) == str(layout.ENGINE_DIR)
        inits = {c["name"]: c["command"] for c in GRAPH["spec"]["services"][name]["extraPodSpec"]["initContainers"]}
        assert inits["engines"][inits["engines"].index("--out") + 1] == str(settings.engine_dir)
        prepare = inits["run-folder"]
        assert prepare[prepare.index("--run-dir") + 1] == str(settings.run_dir)
        assert int(prepare[prepare.index("--max-context") + 1]) == settings.max_context


def _launcher_args(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """The arguments dynamo_deploy.launcher.Deployment gives each process (its start(), processes not spawned). It
    adds no line to the start log, which counts deployments that run (a line here would count one that never did)."""
    log = tmp_path / "starts.log"
    monkeypatch.setenv(START_LOG_ENV, str(log))
    spawned: dict[str, list[str]] = {}
    monkeypatch.setattr(Deployment, "_spawn", lambda self, name, args: spawned.setdefault(name, args))
    monkeypatch.setattr(Deployment, "wait_ready", lambda self, timeout_s: None)
    monkeypatch.setattr(Deployment, "_write_state", lambda self: None)
    Deployment(tmp_path / "run", EMBEDDED, tmp_path / "engines", http_port=18080).start()
    assert not log.exists(), log.read_text()
    return spawned


def _flags(args: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        if args[i].startswith("--"):
            has_value = i + 1 < len(args) and not args[i + 1].startswith("--")
            out[args[i]] = args[i + 1] if has_value else None
            i += 2 if has_value else 1
        else:
            i += 1
    return out


# what differs between a pod and the loopback launcher, and why: paths (the pod layout), the frontend's address
# (every interface in a pod) and a worker's index (from the pod's name)
POD_ONLY_VALUES = {
    "--http-host",
    "--http-port",
    "--run-dir",
    "--model-dir",
    "--engine-dir",
    "--registry-root",
    "--index",
}


def test_the_commands_equal_the_launchers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = _launcher_args(tmp_path, monkeypatch)
    frontend = GRAPH["spec"]["services"][_services("frontend")[0]]["extraPodSpec"]["mainContainer"]
    assert frontend["command"] == ["python"] and frontend["args"][:2] == launcher["frontend"][:2] == [
        "-m",
        "dynamo.frontend",
    ]
    pairs = [(_flags(frontend["args"]), _flags(launcher["frontend"]))]
    for name in _services("worker"):
        module, argv = _worker_argv(name)
        role = _role(name)
        assert launcher[f"{role}-0"][:2] == ["-m", module]
        pairs.append((_flags(argv), _flags(launcher[f"{role}-0"])))
    for graph_flags, launcher_flags in pairs:
        assert set(graph_flags) == set(launcher_flags)
        assert {k: v for k, v in graph_flags.items() if k not in POD_ONLY_VALUES} == {
            k: v for k, v in launcher_flags.items() if k not in POD_ONLY_VALUES
        }
    assert _flags(frontend["args"])["--http-host"] == "0.0.0.0"
    # the environment: the launcher's discovery settings, with the shared volume's discovery folder
    env = {e["name"]: e.get("value") for e in GRAPH["spec"]["envs"]}
    expected = discovery_env(Path(str(layout.DYNAMO_RUN)))
    assert {k: env[k] for k in expected} == expected
    assert env["PYTHONPATH"] == str(layout.PROJECT) and env["OMP_NUM_THREADS"] == "1"


def test_worker_health_follows_its_served_endpoint() -> None:
    """The operator's probes read the worker's system /health, which follows DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS
    (its default, ["generate"], names an endpoint the decoder does not serve: it would never turn ready)."""
    served = {"encoder": "generate", "decoder": "turn"}
    for name in _services("worker"):
        env = {e["name"]: e["value"] for e in GRAPH["spec"]["services"][name]["envs"]}
        assert json.loads(env["DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS"]) == [served[_role(name)]]


# ------------------------------------------------------------------------------------------------------ on loopback
def _free_port(below: int = 65536) -> int:
    """A free loopback port; below 32768 for Dynamo's system port (it parses DYN_SYSTEM_PORT as an i16)."""
    for _ in range(200):
        port = 20000 + int.from_bytes(os.urandom(2), "big") % (below - 20000) if below < 65536 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port")


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


@pytest.mark.slow
def test_the_graphs_commands_serve_a_conversation_on_loopback(tmp_path: Path, default_engines: Path) -> None:
    """Each role's init and main commands from graph.yaml, run here with the pod's paths mapped to a temporary folder:
    the run folder is prepared, the workers turn healthy on their system ports (what the operator probes), the
    frontend answers a conversation on its probes' endpoints, and every Dynamo metric the dashboard queries is in
    its scrape afterwards."""
    from dynamo_deploy.client import Conversation

    if not DYNAMO_PYTHON.exists():
        pytest.fail(f"{DYNAMO_PYTHON} missing: run `bash scripts/setup_dynamo.sh` (scripts/setup.sh does)")
    http_port = _free_port()
    run = tmp_path / "run"
    mapping = [
        (str(layout.ENGINE_DIR), str(default_engines)),
        (str(layout.DYNAMO_RUN), str(run)),
        (str(layout.PROJECT), str(PROJECT_ROOT)),
        ("0.0.0.0", "127.0.0.1"),
    ]

    def local(text: str) -> str:
        for old, new in mapping:
            text = text.replace(old, new)
        return re.sub(r"(^|\s)python(\s)", rf"\g<1>{DYNAMO_PYTHON}\g<2>", text)

    def env_of(name: str, system_port: int) -> dict[str, str]:
        env = dict(os.environ)
        for e in GRAPH["spec"]["envs"] + GRAPH["spec"]["services"][name].get("envs", []):
            env[e["name"]] = local(e["value"]) if "value" in e else "127.0.0.1"  # valueFrom status.podIP
        env["MOL2_ORT_PROVIDERS"] = "CPUExecutionProvider"  # the graph names CUDA first; this machine has no GPU
        env.update(DYN_SYSTEM_ENABLED="true", DYN_SYSTEM_PORT=str(system_port))  # what the operator injects
        return env

    procs: dict[str, subprocess.Popen] = {}
    system_ports: dict[str, int] = {}
    logs = tmp_path / "logs"
    logs.mkdir()
    try:
        for name, svc in GRAPH["spec"]["services"].items():
            system_ports[name] = _free_port(below=32768)
            env = env_of(name, system_ports[name])
            for init in svc["extraPodSpec"].get("initContainers", []):
                if init["name"] == "engines":
                    continue  # built once for the session by the default_engines fixture, the same command
                # an init container has the image's environment and WORKDIR (/opt/mol2), not the graph's envs
                done = subprocess.run(
                    local(" ".join(init["command"])).split(),
                    cwd=PROJECT_ROOT,
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                assert done.returncode == 0, f"{name}/{init['name']}: {done.stdout}{done.stderr}"
            main = svc["extraPodSpec"]["mainContainer"]
            command = main["command"] + [local(a) for a in main["args"]]
            command[0] = str(DYNAMO_PYTHON) if command[0] == "python" else command[0]
            if "--http-port" in command:
                command[command.index("--http-port") + 1] = str(http_port)
            with open(logs / f"{name}.log", "wb") as log:
                procs[name] = subprocess.Popen(
                    command, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
        note_start("dynamo", f"{run} (graph.yaml)")  # a deployment as the launcher's count them (start_log.py)
        url = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 300
        while True:
            dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
            assert not dead, f"exited: {dead}; " + "".join((logs / f"{n}.log").read_text()[-2000:] for n in dead)
            ready = len(list((run / "workers").glob("*.ready"))) if (run / "workers").exists() else 0
            models = _get(f"{url}/v1/models")
            if ready == len(_services("worker")) and models[0] == 200 and '"mol2-small"' in models[1]:
                break
            assert time.monotonic() < deadline, f"not ready: {ready} workers, models {models}"
            time.sleep(0.5)

        chat = Conversation(url, "deploy-s1")
        first = chat.say("Hi! How was your day?", max_tokens=6)
        chat.model = "mol2-small:L2_code"
        second = chat.say("def mean(xs):\n    return sum(xs) / len(xs)", max_tokens=6)
        assert first["text"] and second["text"], (first, second)

        for name in _services("worker"):
            status, body = _get(f"http://127.0.0.1:{system_ports[name]}/health")
            assert status == 200 and json.loads(body)["status"] == "ready", (name, status, body)
            assert _get(f"http://127.0.0.1:{system_ports[name]}/live")[0] == 200
        frontend = GRAPH["spec"]["services"][_services("frontend")[0]]
        for probe in ("readinessProbe", "livenessProbe"):
            status, body = _get(f"{url}{frontend[probe]['httpGet']['path']}")
            assert status == 200, (probe, status, body)

        status, text = _get(f"{url}/metrics")
        assert status == 200
        scrape = parse_scrape(text)
        added = scrape_config_added_labels(load_yaml_documents(PROMETHEUS)[0], "mol2-dynamo-frontend")
        queries = [(t, parse_promql(e)) for t, e in dashboard_queries(json.loads(DASHBOARD.read_text()))]
        dynamo = [(t, q) for t, q in queries if all(s.name.startswith("dynamo_") for s in q.selectors)]
        assert len(dynamo) >= 5
        problems = [p for t, q in dynamo for p in query_problems(t, q, scrape, added)]
        assert problems == []
    finally:
        for p in procs.values():
            if p.poll() is None:
                stop_process(p)
        for p in procs.values():  # nothing of theirs left behind
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
