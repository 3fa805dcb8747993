"""The Kubernetes manifests (deploy/k8s, deploy/dynamo, deploy/monitoring): every object validates against the
Kubernetes schemas (kubernetes-validate, offline, strict), and the pods' probes, GPUs, mounts and parameters agree with
the image, the pod layout (deploy/layout.py) and the model repository they serve.

Overlays are rendered with `kubectl kustomize` (kubectl carries kustomize and is on these machines); without kubectl
the base's files, complete objects each, are validated one by one and the overlay tests skip.
"""

from __future__ import annotations

import copy
import os
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from deploy import layout
from deploy.render_repository import ParameterError, pod_parameters, render
from deploy.sizing import gpus_needed, read_record
from tests.deploy.checks import (
    DOCKERFILE,
    DYNAMO,
    HEALTH_PORT,
    K8S,
    MONITORING,
    OVERLAYS,
    SERVER_WORK_DIR,
    by_kind,
    container,
    entrypoint,
    image_triton_command,
    kubectl,
    kustomize,
    load_yaml_documents,
    one,
    parse_entrypoint,
    validation_problems,
)
from tritonserver_backend.auth.admin_auth import AdminKeyError, read_admin_key

TREES = {
    "base": K8S / "base",
    **{o: K8S / "overlays" / o for o in OVERLAYS},
    "dynamo": DYNAMO,
    "monitoring": MONITORING,
}
CRD_KINDS = {"DynamoGraphDeployment"}  # no schema in kubernetes-validate: tests/deploy/test_dynamo_graph.py checks it


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    if kubectl() is None:
        return {}
    return {name: kustomize(path) for name, path in TREES.items()}


def _tree(rendered: dict[str, list[dict[str, Any]]], name: str) -> list[dict[str, Any]]:
    if not rendered:
        pytest.skip("kubectl (with its kustomize) is not on PATH: overlays are not rendered")
    return rendered[name]


def _pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "Deployment")["spec"]["template"]["spec"]


def test_every_file_is_strict_yaml_and_every_object_validates(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for path in sorted(Path(K8S.parent).rglob("*.yaml")):
        load_yaml_documents(path)  # duplicate keys fail here
    if not rendered:  # no kustomize: the base's resources are complete objects on their own
        listed = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["resources"]
        objects = [o for f in listed for o in load_yaml_documents(K8S / "base" / f)]
        assert validation_problems(objects) == []
        return
    for name, objects in rendered.items():
        checked = [o for o in objects if o["kind"] not in CRD_KINDS]
        assert checked, name
        assert validation_problems(checked) == [], name


def test_validation_fails_on_a_misspelt_field_and_a_wrong_type(rendered: dict[str, list[dict[str, Any]]]) -> None:
    deployment = one(_tree(rendered, "base"), "Deployment")
    typo = copy.deepcopy(deployment)
    c = typo["spec"]["template"]["spec"]["containers"][0]
    c["readinesProbe"] = c.pop("readinessProbe")
    wrong = copy.deepcopy(deployment)
    wrong["spec"]["replicas"] = "two"
    assert len(validation_problems([typo, wrong])) == 2


@pytest.mark.parametrize("tree", ["base", *OVERLAYS])
def test_probes_on_the_supervisors_health_endpoints(rendered: dict[str, list[dict[str, Any]]], tree: str) -> None:
    """The probes read the supervisor (Triton's /v2/health/ready stays 200 after a model's process died): ready is 503
    while it heals, live only once it gave up."""
    c = container(_pod(_tree(rendered, tree)), "tritonserver")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": layout.HTTP_PORT, "grpc": layout.GRPC_PORT, "metrics": layout.METRICS_PORT,
                     "health": HEALTH_PORT}
    args, problems = parse_entrypoint(entrypoint(DOCKERFILE.read_text()))
    assert args is not None, problems
    assert args.health_port == ports["health"] and args.health_address == "0.0.0.0"
    assert c["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "health"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "health"}
    # Triton is ready only after every model loaded: without a startup probe, liveness would kill a loading pod; and
    # the kubelet must not give up before the launcher's own readiness deadline (--timeout) has passed
    assert c["startupProbe"]["httpGet"] == {"path": "/health/ready", "port": "health"}
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= max(300, args.timeout)
    assert not any("/v2/health" in str(c[probe]) for probe in ("startupProbe", "readinessProbe", "livenessProbe"))


@pytest.mark.parametrize("tree", ["base", *OVERLAYS])
def test_the_entrypoint_rules_and_every_container_runs_the_image(
    rendered: dict[str, list[dict[str, Any]]], tree: str
) -> None:
    pod = _pod(_tree(rendered, tree))
    main = container(pod, "tritonserver")
    assert "command" not in main and "args" not in main, "an override would drop the launcher's flags"
    images = {c["image"] for c in pod["containers"] + pod["initContainers"]}
    assert len(images) == 1 and images.pop().startswith("mol2-serving:0.1.0")
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == layout.UID
    command = image_triton_command(entrypoint(DOCKERFILE.read_text()))
    exit_timeout = next(int(a.split("=")[1]) for a in command if a.startswith("--exit-timeout-secs="))
    assert pod["terminationGracePeriodSeconds"] >= exit_timeout + 10  # the launcher's own margin (server.stop)


@pytest.mark.parametrize("tree", ["base", *OVERLAYS])
def test_service_and_pdb_select_the_pods(rendered: dict[str, list[dict[str, Any]]], tree: str) -> None:
    objects = _tree(rendered, tree)
    deployment = one(objects, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service, pdb = one(objects, "Service"), one(objects, "PodDisruptionBudget")
    assert service["spec"]["selector"].items() <= labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port_names = {p["name"] for p in container(deployment["spec"]["template"]["spec"], "tritonserver")["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    assert service["spec"]["sessionAffinity"] == "ClientIP"  # sessions live in one pod's memory
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(layout.METRICS_PORT)


def _mounts(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in c.get("volumeMounts", [])}


def _volume(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(v for v in pod["volumes"] if v["name"] == name)


@pytest.mark.parametrize("tree", ["base", *OVERLAYS])
def test_mounts_are_where_the_repository_parameters_point(rendered: dict[str, list[dict[str, Any]]], tree: str) -> None:
    """admin_key_file, adapter_roots, engine_dir, registry_root and the model repository are the pod's mounts."""
    pod = _pod(_tree(rendered, tree))
    main = _mounts(container(pod, "tritonserver"))
    key_dir = str(layout.ADMIN_KEY_FILE.parent)
    assert main[key_dir]["readOnly"] is True
    assert _volume(pod, main[key_dir]["name"])["emptyDir"]["medium"] == "Memory"  # the key never touches a disk
    adapters = main[str(layout.ADAPTERS)]
    assert adapters["readOnly"] is True and "persistentVolumeClaim" in _volume(pod, adapters["name"])
    assert main[str(layout.ENGINES)]["readOnly"] is True
    assert not main[str(layout.REGISTRY_ROOT)].get("readOnly", False)
    # the launcher's work dir (the session journal, sessions/) is writable and outlives a container restart (an
    # emptyDir lives as long as the pod; the image's own directory would start empty in every new container)
    work = main[SERVER_WORK_DIR]
    assert not work.get("readOnly", False) and "emptyDir" in _volume(pod, work["name"])
    repo = main[str(layout.MODEL_REPOSITORY)]
    params = pod_parameters({})
    assert params["admin_key_file"] == str(layout.ADMIN_KEY_FILE)
    assert params["adapter_roots"].split(":") == [str(layout.ADAPTERS)]
    assert PurePosixPath(params["engine_dir"]).parent == layout.ENGINES
    assert params["registry_root"] == str(layout.REGISTRY_ROOT)

    key_init = container(pod, "admin-key", init=True)
    assert key_init["command"][:3] == ["install", "-m", "0600"] and key_init["command"][-1] == str(
        layout.ADMIN_KEY_FILE
    )
    secret_dir = _mounts(key_init)[str(layout.ADMIN_SECRET_DIR)]
    assert _volume(pod, secret_dir["name"])["secret"]["secretName"] == "mol2-admin-key"
    assert _mounts(key_init)[key_dir]["name"] == main[key_dir]["name"]

    engines_init = container(pod, "engines", init=True)
    assert engines_init["command"][engines_init["command"].index("--out") + 1] == params["engine_dir"]
    assert engines_init["command"][engines_init["command"].index("--model") + 1] == params["model_dir"]
    assert _mounts(engines_init)[str(layout.ENGINES)]["name"] == main[str(layout.ENGINES)]["name"]

    repo_init = container(pod, "model-repository", init=True)
    cmd = repo_init["command"]
    assert cmd[cmd.index("--out") + 1] == str(layout.MODEL_REPOSITORY)
    assert _mounts(repo_init)[str(layout.MODEL_REPOSITORY)]["name"] == repo["name"]
    parameters = _mounts(repo_init)[cmd[cmd.index("--parameters-dir") + 1]]
    assert _volume(pod, parameters["name"])["configMap"]["name"] == "mol2-parameters"


def test_configmap_parameters_render_into_the_served_repository(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    data = one(_tree(rendered, "base"), "ConfigMap")["data"]
    folder = tmp_path / "parameters"
    folder.mkdir()
    for key, value in data.items():  # as Kubernetes mounts a ConfigMap: a file per key, plus its own ..data entries
        (folder / key).write_text(value)
    (folder / "..data").mkdir()
    from deploy.render_repository import main

    out = tmp_path / "repo"
    code = main(["--out", str(out), "--parameters-dir", str(folder), "--remap", f"/var/lib/mol2={tmp_path}/state"])
    assert code == 0
    decoder = (out / "decoder" / "config.pbtxt").read_text()
    assert f'key: "max_active_turns"\n  value: {{ string_value: "{data["max_active_turns"]}" }}' in decoder
    assert f'string_value: "{tmp_path}/state/engines/mol2-small"' in decoder
    admin = (out / "adapter_admin" / "config.pbtxt").read_text()
    assert f'string_value: "{layout.ADMIN_KEY_FILE}"' in admin and f'string_value: "{tmp_path}/state/adapters"' in admin
    assert (out / "decoder" / "1" / "model.py").is_file()


@pytest.mark.parametrize("bad", [{"max_active_turn": "8"}, {"engine_dir": "/elsewhere"}, {"admin_key_file": "/tmp/k"}])
def test_a_misspelt_or_path_parameter_fails_the_render(bad: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(ParameterError):
        render(tmp_path / "repo", bad)


def _kubelet_secret_volume(folder: Path, key: str, mode: int) -> Path:
    """A Secret volume as the kubelet writes it: the file in a timestamped folder, `..data` linking to that folder,
    and the key's name linking through `..data`."""
    stamp = folder / "..2026_01_01_00_00_00.000000001"
    stamp.mkdir(parents=True)
    (stamp / "admin.key").write_text(key + "\n")
    os.chmod(stamp / "admin.key", mode)
    (folder / "..data").symlink_to(stamp.name)
    (folder / "admin.key").symlink_to("..data/admin.key")
    return folder / "admin.key"


def test_the_admin_key_is_usable_only_through_the_init_copy(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """Mounted directly under fsGroup the Secret's file is 0440, which the server refuses (group-readable); the init
    container's own command turns it into a 0600 file that the server accepts."""
    key = "k" * 43
    secret = _kubelet_secret_volume(tmp_path / "etc" / "mol2" / "admin-secret", key, 0o440)
    with pytest.raises(AdminKeyError, match="0440"):
        read_admin_key(secret)
    command = container(_pod(_tree(rendered, "base")), "admin-key", init=True)["command"]
    local = [a.replace("/etc/mol2", str(tmp_path / "etc" / "mol2")) for a in command]
    Path(local[-1]).parent.mkdir(parents=True)
    subprocess.run(local, check=True, timeout=10)
    assert read_admin_key(local[-1]) == key


def test_gpus_are_the_planners_count(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for tree in ("base", "cpu"):
        resources = container(_pod(_tree(rendered, tree)), "tritonserver")["resources"]
        assert "nvidia.com/gpu" not in {**resources.get("requests", {}), **resources.get("limits", {})}
    for tree in ("gpu", "gpu-tp"):
        pod = _pod(_tree(rendered, tree))
        resources = container(pod, "tritonserver")["resources"]
        inputs, figures, recorded = read_record(K8S / "overlays" / tree / "sizing.json")
        assert recorded == gpus_needed(inputs, figures)
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == str(recorded)
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        assert {e["name"]: e["value"] for e in container(pod, "tritonserver")["env"]}["MOL2_ORT_PROVIDERS"].startswith(
            "CUDAExecutionProvider"
        )
    assert read_record(K8S / "overlays" / "gpu-tp" / "sizing.json")[2] > 1  # the TP group: one pod, several GPUs


def test_the_overlays_differ_where_they_should(rendered: dict[str, list[dict[str, Any]]]) -> None:
    cpu, gpu = _tree(rendered, "cpu"), _tree(rendered, "gpu")
    assert one(cpu, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert one(gpu, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]
    assert {c["image"] for c in _pod(gpu)["containers"]} == {"mol2-serving:0.1.0-gpu"}
    assert len(by_kind(_tree(rendered, "monitoring"), "ConfigMap")) == 1
