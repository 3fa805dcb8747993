"""Monitoring (deploy/monitoring): the Grafana dashboard's queries against what a real server exposes, and the
Prometheus scrape config against the pods it must find.

The slow test serves the pod's model repository (rendered by deploy.render_repository, the ConfigMap's parameters)
with a real tritonserver started with the image's entrypoint flags (as the launcher reads them), holds a
conversation (routed turns, an explicit adapter, a burst that gets busy refusals), scrapes the metrics port and checks
every metric name, label matcher and grouping label the dashboard's Triton panels use. The Dynamo panels are checked
the same way against the frontend of the graph run on loopback (tests/deploy/test_dynamo_graph.py).
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy import layout
from deploy.render_repository import render
from tests.deploy.checks import (
    DASHBOARD,
    DOCKERFILE,
    DYNAMO,
    K8S,
    PROMETHEUS,
    Query,
    dashboard_queries,
    entrypoint,
    load_yaml_documents,
    parse_entrypoint,
    parse_promql,
    parse_scrape,
    query_problems,
    sample_values,
    scrape_config_added_labels,
)
from tests.tiny import PROJECT_ROOT
from tritonserver_backend.core.counters import DESCRIPTIONS
from tritonserver_backend.launcher.supervise import start_kwargs_from_args
from tritonserver_backend.triton.glue import GAUGE_METRICS, HISTOGRAM_METRICS, ITL_METRIC, TTFT_METRIC

DASH: dict[str, Any] = json.loads(DASHBOARD.read_text())
CONFIG: dict[str, Any] = load_yaml_documents(PROMETHEUS)[0]
QUERIES = [(title, parse_promql(expr)) for title, expr in dashboard_queries(DASH)]


def _job_of(query: Query) -> str:
    prefixes = {s.name.split("_", 1)[0] for s in query.selectors}
    assert prefixes and (prefixes <= {"nv", "mol2"} or prefixes == {"dynamo"}), f"mixes jobs: {query.expr}"
    return "mol2-dynamo-frontend" if prefixes == {"dynamo"} else "mol2-triton"


def test_the_dashboard_has_the_panels_the_issue_asks_for() -> None:
    panels = [p for p in DASH["panels"] if p["type"] != "row"]
    titles = " | ".join(p["title"].lower() for p in panels)
    for wanted in (
        "tokens/s",
        "time to first token",
        "inter-token latency",
        "itl",
        "queue",
        "busy refusals",
        "written / read / applied",
        "replays",
        "session memory against its budget",
    ):
        assert wanted in titles, wanted
    ids = [p["id"] for p in DASH["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels:
        if p["type"] == "timeseries":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
    assert {v["name"] for v in DASH["templating"]["list"]} == {"datasource"}


def test_every_query_reads_one_scrape_job_and_project_counters_exist() -> None:
    jobs = {_job_of(q) for _, q in QUERIES}
    assert jobs == {"mol2-triton", "mol2-dynamo-frontend"}
    project = {s.name for _, q in QUERIES for s in q.selectors if s.name.startswith("mol2_")}
    exported = {f"mol2_{n}" for n in DESCRIPTIONS} | set(GAUGE_METRICS) | {f"{h}_bucket" for h in HISTOGRAM_METRICS}
    assert project and project <= exported
    assert set(GAUGE_METRICS) | {f"{h}_bucket" for h in HISTOGRAM_METRICS} | {"mol2_turns_refused"} <= project


def test_the_query_check_notices_a_missing_metric_a_wrong_value_and_a_missing_label() -> None:
    scrape = {"mol2_replays": [{"adapter": "L0_chat"}], "nv_inference_count": [{"model": "mol2", "version": "1"}]}
    ok = parse_promql("sum by (adapter, pod) (rate(mol2_replays[$__rate_interval]))")
    assert query_problems("t", ok, scrape, {"pod"}) == []
    for expr in (
        "rate(mol2_replayz[5m])",
        'nv_inference_count{model="mol3"}',
        'nv_inference_count{model=~"mol2|x"}',
        "sum by (adapter) (nv_inference_count)",
        'nv_inference_count{kind="decode"}',
    ):
        assert query_problems("t", parse_promql(expr), scrape, {"pod"}) != [], expr


def test_the_scrape_config_finds_the_pods_and_adds_the_dashboards_labels() -> None:
    deployment = next(d for d in load_yaml_documents(K8S / "base" / "deployment.yaml"))
    graph = load_yaml_documents(DYNAMO / "graph.yaml")[0]
    frontend = next(s for s in graph["spec"]["services"].values() if s["componentType"] == "frontend")
    pods = {
        "mol2-triton": deployment["spec"]["template"]["metadata"],
        "mol2-dynamo-frontend": frontend["extraPodMetadata"],
    }
    for job, meta in pods.items():
        scrape = next(s for s in CONFIG["scrape_configs"] if s["job_name"] == job)
        keep = {tuple(r["source_labels"]): r["regex"] for r in scrape["relabel_configs"] if r.get("action") == "keep"}
        assert keep[("__meta_kubernetes_pod_label_app_kubernetes_io_name",)] == meta["labels"]["app.kubernetes.io/name"]
        assert (
            keep[("__meta_kubernetes_pod_annotation_prometheus_io_scrape",)]
            == meta["annotations"]["prometheus.io/scrape"]
        )
        assert meta["annotations"]["prometheus.io/path"] == "/metrics"
        assert scrape_config_added_labels(CONFIG, job) == {"namespace", "pod"}
    assert pods["mol2-triton"]["annotations"]["prometheus.io/port"] == str(layout.METRICS_PORT)
    ports = frontend["extraPodSpec"]["mainContainer"]["ports"]
    assert pods["mol2-dynamo-frontend"]["annotations"]["prometheus.io/port"] == str(ports[0]["containerPort"])
    groupings = {label for _, q in QUERIES for label in q.grouping} - {
        "le",
        "adapter",
        "kind",
        "model",
        "reason",
        "status",
        "error_type",
        "store",
        "partition",
    }
    assert groupings <= scrape_config_added_labels(CONFIG, "mol2-triton")


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


@pytest.mark.slow
def test_every_triton_metric_the_dashboard_queries_is_exposed_after_a_conversation(
    tmp_path: Path, default_engines: Path
) -> None:
    from tests.tritonserver_backend.streams import concurrent_token_ids
    from tritonserver_backend.clients.client import GrpcChat, TurnRequest
    from tritonserver_backend.launcher import TritonServer

    # the pod's repository: the ConfigMap's parameters, the layout's paths under tmp_path; one turn at a time and no
    # queue, so that a burst of turns gets busy refusals
    state = tmp_path / "state"
    (state / "engines").mkdir(parents=True)
    (state / "engines" / "mol2-small").symlink_to(default_engines)
    parameters = yaml.safe_load((K8S / "base" / "parameters.yaml").read_text())["data"]
    remap = {str(layout.STATE): str(state), "/etc/mol2": str(tmp_path / "etc"), str(layout.PROJECT): str(PROJECT_ROOT)}
    repo = render(tmp_path / "repo", {**parameters, "max_active_turns": "1", "max_queued_turns": "0"}, remap)
    (tmp_path / "etc" / "admin").mkdir(parents=True)
    # the image's entrypoint flags, through the launcher's own parsing (supervise.start_kwargs_from_args); only what
    # ties it to the pod stays here: loopback, free ports, this test's repository, PID file and log
    args, problems = parse_entrypoint(entrypoint(DOCKERFILE.read_text()))
    assert args is not None, problems
    image = start_kwargs_from_args(args)
    server = TritonServer(work_dir=tmp_path / "server")
    try:
        server.start(repo, extra_args=image["extra_args"], model_control_mode=image["model_control_mode"],
                     load_models=image["load_models"], exit_timeout=image["exit_timeout"])
        server.wait_ready(300)
        chat = GrpcChat(server.grpc_url)
        try:
            turns = [
                TurnRequest("m1", "Hi! How was your day?", new_session=True, max_tokens=4),
                TurnRequest("m1", "import os\nprint(os.listdir('.'))", max_tokens=4),
                TurnRequest("m1", "Thanks, that helps.", adapter="L0_chat", max_tokens=4),
            ]
            for t in turns:
                reply = chat.turn(t)
                assert reply.error is None and reply.token_ids, reply.error
        finally:
            chat.close()
        busy: list[str] = []
        for attempt in range(3):
            burst = [
                [TurnRequest(f"b{attempt}-{i}", "Tell me a long story about a dog.", new_session=True, max_tokens=24)]
                for i in range(3)
            ]
            busy += [e for e in concurrent_token_ids(server.grpc_url, burst)[1] if "server busy" in e]
            if busy:
                break
        assert busy, "no busy refusal in three bursts of three turns (max_active_turns 1, max_queued_turns 0)"
        time.sleep(1)
        text = _scrape(server.metrics_url)
    finally:
        server.stop()
    scrape = parse_scrape(text)

    added = scrape_config_added_labels(CONFIG, "mol2-triton")
    triton = [(t, q) for t, q in QUERIES if _job_of(q) == "mol2-triton"]
    assert len(triton) >= 10
    assert [p for t, q in triton for p in query_problems(t, q, scrape, added)] == []
    # refused turns count as failed ensemble requests, and as the encoder's refusals by reason (busy ones exactly)
    failed = sum(v for labels, v in sample_values(text, "nv_inference_request_failure") if labels["model"] == "mol2")
    assert failed >= len(busy)
    refused = {labels["reason"]: v for labels, v in sample_values(text, "mol2_turns_refused")}
    assert refused == {"busy": len(busy), "context_limit": 0}, refused
    # every streamed turn with tokens observed its time to first token and (with two or more) its mean inter-token
    # time: at least the three conversation turns, at most every turn that was not refused
    served = len(turns) + 3 * (attempt + 1) - len(busy)
    for histogram in (TTFT_METRIC, ITL_METRIC):
        count = sum(v for _, v in sample_values(text, f"{histogram}_count"))
        total = sum(v for _, v in sample_values(text, f"{histogram}_sum"))
        print(f"{histogram}: {count:.0f} turns, mean {total / max(count, 1):.4f} s")
        assert len(turns) <= count <= served, (histogram, count, served)
    held = {labels["store"]: v for labels, v in sample_values(text, "mol2_session_bytes")}
    budget = {labels["store"]: v for labels, v in sample_values(text, "mol2_session_budget_bytes")}
    assert set(held) == set(budget) == {"encoder", "decoder"} and all(v > 0 for v in held.values()), held
    assert all(v == float(parameters["session_budget_bytes"]) for v in budget.values()), budget
    # and the check fails for real on this scrape: a counter that nothing incremented is not exposed at all
    missing = parse_promql("sum by (adapter) (rate(mol2_routing_decisions_rejected[5m]))")
    assert query_problems("rejected", missing, scrape, added) == [
        "'rejected': mol2_routing_decisions_rejected: not exposed by the server"
    ]
