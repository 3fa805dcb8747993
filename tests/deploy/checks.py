"""What the deploy tests share: reading the Dockerfile, the tritonserver command line its entrypoint makes the launcher
build, rendering the Kustomize trees, PromQL selectors and Prometheus scrapes.

Each check returns a list of problems (empty: fine) instead of asserting, so that a test can run it on the real files
and again on a broken copy and see it complain: the checks are shown to fail for real, not only to pass.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import json
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable

import yaml

from deploy import layout
from tests.tiny import PROJECT_ROOT

DEPLOY = PROJECT_ROOT / "deploy"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
K8S = DEPLOY / "k8s"
OVERLAYS = ("cpu", "gpu", "gpu-tp")
DYNAMO = DEPLOY / "dynamo"
MONITORING = DEPLOY / "monitoring"
DASHBOARD = MONITORING / "grafana" / "mol2-serving.json"
PROMETHEUS = MONITORING / "prometheus.yaml"
# the Kubernetes version the manifests are validated against: kubernetes-validate ships its schemas (offline), and
# 1.32 is the oldest release the manifests' fields need that is still common in managed clusters
KUBERNETES_VERSION = "1.32.0"


# ------------------------------------------------------------------------------------------------------ Dockerfile
def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments and blank lines dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def dockerfile_stages(text: str) -> dict[str, list[tuple[str, str]]]:
    """The instructions of each build stage, by its `AS` name (the FROM line is the stage's first instruction)."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for word, rest in dockerfile_instructions(text):
        if word == "FROM":
            parts = rest.split()
            name = parts[parts.index("AS") + 1] if "AS" in parts else f"stage{len(stages)}"
            current = stages.setdefault(name, [])
        if current is not None:
            current.append((word, rest))
    return stages


def exec_form(arguments: str) -> list[str]:
    """An ENTRYPOINT/CMD in exec (JSON) form; a shell form would hide the flags in a string, so it is refused."""
    value = json.loads(arguments)
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ValueError(f"not an exec-form array: {arguments}")
    return value


def entrypoint(text: str, stage: str = "triton") -> list[str]:
    found = [rest for word, rest in dockerfile_stages(text)[stage] if word == "ENTRYPOINT"]
    if not found:
        raise ValueError(f"stage {stage!r} has no ENTRYPOINT")
    return exec_form(found[-1])


# What the triton stage's ENTRYPOINT runs: the supervised launcher in the foreground (it must stay PID 1's child, not
# detach), under tini (PID 1 reaps the stubs a restart orphans), from the image's WORKDIR (the checkout)
LAUNCHER_ENTRYPOINT = ["tini", "--", "python", "scripts/tritonserver.py", "start", "--foreground"]
HEALTH_PORT = 8003  # the supervisor's /health/live and /health/ready in a pod (supervise.py's default too)
SERVER_WORK_DIR = "/var/lib/mol2/server"  # the launcher's work dir in the image: PID files, logs, sessions/
ALL_INTERFACES = "0.0.0.0"
IMAGE_TRITONSERVER = Path("/opt/tritonserver/bin/tritonserver")  # NGC's binary, on the image's PATH
IMAGE_BACKENDS = Path("/opt/tritonserver/backends")  # a system install's backends (launcher/install.py)

# The tritonserver flags a pod needs: those the image passed before the supervisor (model repository, control mode,
# exit timeout, the mol2-* header forwarding that carries the admin key, GPU metrics on: Triton's default), and what
# the launcher now builds for the pod: every interface on Triton's default ports, the image's own backends
POD_TRITON_FLAGS = {
    "--model-repository": str(layout.MODEL_REPOSITORY),
    "--backend-directory": str(IMAGE_BACKENDS),
    "--http-address": ALL_INTERFACES,
    "--http-port": str(layout.HTTP_PORT),
    "--grpc-address": ALL_INTERFACES,
    "--grpc-port": str(layout.GRPC_PORT),
    "--metrics-address": ALL_INTERFACES,
    "--metrics-port": str(layout.METRICS_PORT),
    "--model-control-mode": "none",
    "--exit-timeout-secs": "10",
    "--grpc-header-forward-pattern": "mol2-.*",
    "--http-header-forward-pattern": "mol2-.*",
    "--allow-gpu-metrics": "true",
}


@functools.cache
def launcher_cli() -> ModuleType:
    """scripts/tritonserver.py as a module (a script, not a package): its own parser reads the entrypoint."""
    path = PROJECT_ROOT / "scripts" / "tritonserver.py"
    spec = importlib.util.spec_from_file_location("mol2_scripts_tritonserver", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_entrypoint(image: list[str]) -> tuple[argparse.Namespace | None, list[str]]:
    """The ``start`` flags of an entrypoint that runs LAUNCHER_ENTRYPOINT, parsed by the CLI's own parser; (None,
    problems) when it runs something else or the parser refuses it."""
    if image[: len(LAUNCHER_ENTRYPOINT) - 1] != LAUNCHER_ENTRYPOINT[:-1]:
        return None, [f"the entrypoint does not run {' '.join(LAUNCHER_ENTRYPOINT[:-1])}: {image[:5]}"]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = launcher_cli().build_parser().parse_args(image[len(LAUNCHER_ENTRYPOINT) - 2 :])
    except SystemExit:
        return None, [f"scripts/tritonserver.py refuses the entrypoint: {errors.getvalue().strip()}"]
    return args, []


def entrypoint_problems(image: list[str]) -> list[str]:
    """What is wrong with how the entrypoint runs the launcher in a pod (not Triton's flags: triton_flag_problems)."""
    args, problems = parse_entrypoint(image)
    if args is None:
        return problems
    wanted = {
        "foreground": (True, "without it the launcher detaches and the container ends"),
        "no_supervise": (False, "nothing would restart a dead model process"),
        "health_address": (ALL_INTERFACES, "the kubelet's probes come from outside the container"),
        "health_port": (HEALTH_PORT, "the probes' port"),
        "prefer": ("system", "NGC's tritonserver and its backends, with the linked 3.11 stub"),
        "work_dir": (SERVER_WORK_DIR, "the default (the checkout's build/) is not writable by uid 1000"),
        "no_engine_build": (True, "the engines are an init container's read-only mount"),
    }
    for name, (value, why) in wanted.items():
        if getattr(args, name) != value:
            problems.append(f"--{name.replace('_', '-')}: {getattr(args, name)!r}, want {value!r} ({why})")
    return problems


def image_triton_command(image: list[str]) -> list[str]:
    """The tritonserver command line the launcher builds from the entrypoint's flags: the CLI's parser, the
    supervisor's start arguments (supervise.start_kwargs_from_args) and TritonServer.build_command, nothing copied; the
    install is the image's system one (tests/deploy/test_image.py checks install.py resolves it so)."""
    from tritonserver_backend.launcher.install import TritonInstall
    from tritonserver_backend.launcher.server import TritonServer
    from tritonserver_backend.launcher.supervise import start_kwargs_from_args

    args, problems = parse_entrypoint(image)
    if args is None:
        raise ValueError("; ".join(problems))
    kwargs = start_kwargs_from_args(args)
    install = TritonInstall(binary=IMAGE_TRITONSERVER, source="system", backend_dir=IMAGE_BACKENDS)
    server = TritonServer(install=install, work_dir=args.work_dir)
    server.http_port, server.grpc_port, server.metrics_port = (
        kwargs["http_port"], kwargs["grpc_port"], kwargs["metrics_port"])
    return server.build_command(kwargs["model_repository"], IMAGE_BACKENDS, kwargs["extra_args"],
                                kwargs["model_control_mode"], kwargs["load_models"], kwargs["exit_timeout"],
                                bind_address=kwargs["bind_address"])


def _split_flag(arg: str) -> tuple[str, str | None]:
    name, sep, value = arg.partition("=")
    return name, (value if sep else None)


def triton_flag_problems(command: list[str], expected: dict[str, str] = POD_TRITON_FLAGS) -> list[str]:
    """Differences between a tritonserver command line and the flags a pod needs, both directions: each expected flag
    once with its value, and no flag beyond them (a new launcher flag must be added here, with its pod value)."""
    problems = []
    if not command or Path(command[0]).name != "tritonserver":
        problems.append(f"the command does not start tritonserver: {command[:1]}")
    flags = [_split_flag(a) for a in command[1:]]
    names = [name for name, _ in flags]
    problems += [f"{name}: given {names.count(name)} times" for name in sorted(set(names)) if names.count(name) > 1]
    given = dict(flags)
    for name, value in expected.items():
        if name not in given:
            problems.append(f"{name}={value}: missing")
        elif given[name] != value:
            problems.append(f"{name}: {given[name]!r}, want {value!r}")
    problems += [f"{name}={value}: not a flag the pod expects" for name, value in given.items() if name not in expected]
    return problems


# ------------------------------------------------------------------------------------------------------ Kubernetes
def kubectl() -> str | None:
    return shutil.which("kubectl")


def kustomize(folder: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize` (the kustomize built into kubectl; offline) -> the rendered objects."""
    binary = kubectl()
    if binary is None:
        raise RuntimeError("kubectl is not on PATH (it carries kustomize)")
    done = subprocess.run([binary, "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {folder} failed: {done.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    """Strict YAML: duplicate keys are an error (PyYAML keeps the last one silently)."""

    class StrictLoader(yaml.SafeLoader):
        pass

    def construct_mapping(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
        keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
        duplicates = {k for k in keys if keys.count(k) > 1}
        if duplicates:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate keys {sorted(duplicates)}", node.start_mark)
        return loader.construct_mapping(node, deep=deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return [doc for doc in yaml.load_all(path.read_text(), Loader=StrictLoader) if doc]


def validation_problems(objects: Iterable[dict[str, Any]]) -> list[str]:
    """kubernetes-validate, strict (unknown fields are errors), against KUBERNETES_VERSION's bundled schemas."""
    import kubernetes_validate

    problems = []
    for obj in objects:
        name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            problems.append(f"{name}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(f"{name}: {exc.message}")
    return problems


def by_kind(objects: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o.get("kind") == kind]


def one(objects: Iterable[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container(pod_spec: dict[str, Any], name: str, init: bool = False) -> dict[str, Any]:
    for c in pod_spec.get("initContainers" if init else "containers", []):
        if c["name"] == name:
            return c
    raise KeyError(name)


# ------------------------------------------------------------------------------------------------------ PromQL
PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
}


@dataclass
class Selector:
    name: str
    matchers: list[tuple[str, str, str]] = field(default_factory=list)  # (label, op, value)


@dataclass
class Query:
    expr: str
    selectors: list[Selector]
    grouping: set[str]  # labels named in by (...) / without (...)


PROMQL_AGGREGATIONS = {
    "sum",
    "avg",
    "min",
    "max",
    "count",
    "group",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "limitk",
    "limit_ratio",
}
_TOKEN = re.compile(
    r'"(?:[^"\\]|\\.)*"|\[[^\]]*\]|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|[A-Za-z_:][A-Za-z0-9_:]*|\{|\}|\(|\)'
    r"|=~|!~|!=|=|,|[^\s]"
)


def parse_promql(expr: str) -> Query:
    """The metric selectors (name + label matchers) and grouping labels of a PromQL expression.

    Enough PromQL for dashboards: functions are identifiers followed by `(`, `by`/`without` lists are labels,
    ranges and strings are skipped; Grafana's `$__rate_interval` is replaced by a fixed range first."""
    expr_ = re.sub(r"\$__\w+", "5m", expr)
    tokens = _TOKEN.findall(expr_)
    selectors: list[Selector] = []
    grouping: set[str] = set()
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if tok in ("by", "without", "on", "ignoring", "group_left", "group_right") and nxt == "(":
            j = i + 2
            while tokens[j] != ")":
                if tokens[j] != ",":
                    grouping.add(tokens[j])
                j += 1
            i = j + 1
            continue
        if tok == "offset":  # offset 5m: a duration, not a metric
            i += 3 if i + 2 < len(tokens) and re.fullmatch(r"[smhdwy]+", tokens[i + 2]) else 2
            continue
        if tok in PROMQL_AGGREGATIONS and nxt in ("(", "by", "without"):
            i += 1
            continue
        if re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", tok) and nxt != "(" and tok.lower() not in PROMQL_KEYWORDS:
            sel = Selector(tok)
            if nxt == "{":
                j = i + 2
                while tokens[j] != "}":
                    if tokens[j] == ",":
                        j += 1
                        continue
                    label, op, value = tokens[j], tokens[j + 1], tokens[j + 2]
                    sel.matchers.append((label, op, json.loads(value)))
                    j += 3
                i = j
            selectors.append(sel)
        i += 1
    return Query(expr, selectors, grouping)


# ------------------------------------------------------------------------------------------------------ scrapes
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+\S+")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_scrape(text: str) -> dict[str, list[dict[str, str]]]:
    """Prometheus text exposition -> {metric name: [the label set of each series]}."""
    series: dict[str, list[dict[str, str]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            series.setdefault(m.group(1), []).append(dict(_LABEL.findall(m.group(3) or "")))
    return series


def sample_values(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of metric ``name`` in a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            out.append((dict(_LABEL.findall(m.group(3) or "")), float(line.rsplit(None, 1)[-1])))
    return out


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every Prometheus target of every panel, rows' nested panels included."""
    out = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((p.get("title", ""), t["expr"]))
            walk(p.get("panels", []))

    walk(dashboard.get("panels", []))
    return out


def query_problems(
    title: str, query: Query, scrape: dict[str, list[dict[str, str]]], added_labels: set[str]
) -> list[str]:
    """Each metric queried must be in the scrape; each label matcher must name a label its series carry (and for `=`
    and `=~`, a value one of them has); each grouping label must be on every metric of the expression, unless the
    scrape config adds it (`added_labels`: pod, namespace)."""
    problems = []
    for sel in query.selectors:
        where = f"{title!r}: {sel.name}"
        if sel.name not in scrape:
            problems.append(f"{where}: not exposed by the server")
            continue
        label_sets = scrape[sel.name]
        for label, op, value in sel.matchers:
            if label in added_labels:
                continue
            values = {s[label] for s in label_sets if label in s}
            if not values:
                problems.append(f"{where}: no series has label {label!r}")
            elif op == "=" and value not in values:
                problems.append(f"{where}: no series with {label}={value!r} (seen {sorted(values)})")
            elif op == "=~" and not any(re.fullmatch(value, v) for v in values):
                problems.append(f"{where}: no series matches {label}=~{value!r} (seen {sorted(values)})")
            elif op == "=~":
                missing = [alt for alt in value.split("|") if re.fullmatch(r"[\w.:-]+", alt) and alt not in values]
                problems += [f"{where}: no series with {label}={alt!r} (in {value!r})" for alt in missing]
    for label in query.grouping - added_labels:
        for sel in query.selectors:
            if sel.name in scrape and not all(label in s for s in scrape[sel.name]):
                problems.append(f"{title!r}: grouped by {label!r}, which {sel.name} does not carry on every series")
    return problems


def scrape_config_added_labels(config: dict[str, Any], job: str) -> set[str]:
    """The labels a scrape job's relabelling adds to every series (target labels that are not __internal__)."""
    for scrape in config["scrape_configs"]:
        if scrape["job_name"] == job:
            return {
                r["target_label"]
                for r in scrape.get("relabel_configs", [])
                if "target_label" in r and not r["target_label"].startswith("__")
            }
    raise KeyError(job)


def shell_words(command: str) -> list[str]:
    return shlex.split(command)
