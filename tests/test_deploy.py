"""The scaled-out deployment, checked without a docker engine: docker-compose.yml, the OpenTelemetry
Collector, Prometheus and Grafana configs agree with each other and with what the collector exports."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from psycopg.conninfo import conninfo_to_dict
from prometheus_client.parser import text_string_to_metric_families

from collector.config import load_config, split_endpoint
from conftest import CollectorProcess, export_spans, post
from mafshape import SCENARIOS, export_request, record

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
#: Our replicas are the services built from this repository's Dockerfile.
REPLICAS = sorted(name for name, svc in SERVICES.items() if svc.get("build") == ".")
#: ${env:NAME} or ${env:NAME:-default} in config/otelcol.yaml (the collector's own expansion).
ENV_REF = re.compile(r"\$\{env:(\w+)(?::-([^}]*))?\}")


def _resolved(node: Any, env: dict[str, str]) -> Any:
    """A config as the collector resolves it in ``env``: each ${env:NAME:-default} takes NAME's value,
    else the default; a value that is one reference alone is then read as YAML (a list, a number)."""
    if isinstance(node, dict):
        return {key: _resolved(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [_resolved(value, env) for value in node]
    if not isinstance(node, str):
        return node

    def value(ref: re.Match) -> str:
        return env.get(ref.group(1), ref.group(2) or "")

    whole = ENV_REF.fullmatch(node)
    return yaml.safe_load(value(whole)) if whole else ENV_REF.sub(value, node)


#: config/otelcol.yaml with the values of the compose otelcol service's environment.
OTELCOL = _resolved(yaml.safe_load((ROOT / "config/otelcol.yaml").read_text()),
                    SERVICES["otelcol"].get("environment", {}))
PROMETHEUS = yaml.safe_load((ROOT / "config/prometheus.yml").read_text())
ALERTS = yaml.safe_load((ROOT / "config/alerts.yml").read_text())
DASHBOARD = json.loads((ROOT / "config/grafana/dashboards/fidelity.json").read_text())
#: Series Prometheus makes itself rather than scraping them.
PROMETHEUS_OWN = {"up"}


def _mounts(service: str) -> dict[str, Path]:
    """container path -> repository path, for the service's bind mounts."""
    out = {}
    for volume in SERVICES[service].get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            out[target] = ROOT / source
    return out


def _mounted_config(service: str, container_path: str) -> Path:
    mounts = _mounts(service)
    for target, source in mounts.items():
        if container_path == target:
            return source
        if container_path.startswith(target.rstrip("/") + "/"):
            return source / container_path[len(target.rstrip("/")) + 1:]
    raise AssertionError(f"{service} does not mount {container_path}")


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def test_compose_has_the_documented_topology():
    assert {"otelcol", "jaeger", "prometheus", "grafana"} <= set(SERVICES)
    assert len(REPLICAS) >= 2
    for name, svc in SERVICES.items():
        if "image" in svc and name not in REPLICAS:
            assert not svc["image"].endswith(":latest") and ":" in svc["image"], f"{name}: pin the image"
        for dep in svc.get("depends_on", []):
            assert dep in SERVICES, f"{name} depends on unknown service {dep}"
    named = set(COMPOSE.get("volumes", {}))
    for name in SERVICES:
        for volume in SERVICES[name].get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in named, f"{name} uses undeclared volume {source}"
    host_ports = [p.split(":")[0] for svc in SERVICES.values() for p in svc.get("ports", [])]
    assert len(host_ports) == len(set(host_ports)), "two services publish the same host port"


def test_dockerfile_copies_only_what_exists_and_runs_the_collector():
    dockerfile = (ROOT / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"
    assert 'ENTRYPOINT ["agenteval", "collector", "serve"]' in dockerfile
    exposed = {int(p) for line in dockerfile.splitlines() if line.startswith("EXPOSE") for p in line.split()[1:]}
    cfg = load_config(_mounted_config(REPLICAS[0], "/etc/agenteval/collector.yaml"))
    assert exposed == {split_endpoint(e)[1] for e in (cfg.receivers.grpc.endpoint, cfg.receivers.http.endpoint,
                                                       cfg.exporters.prometheus.endpoint)}


def test_otelcol_is_our_distribution_built_from_its_manifest_on_the_tested_config():
    svc = SERVICES["otelcol"]
    assert svc["build"] == {"context": ".", "dockerfile": "otelcol/Dockerfile"}
    dockerfile = (ROOT / "otelcol/Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"otelcol/Dockerfile copies missing {source}"
    assert "otelcol/build.sh" in dockerfile  # the same build as `make otelcol`, which the tests run
    manifest = yaml.safe_load((ROOT / "otelcol/manifest.yaml").read_text())
    assert f'ENTRYPOINT ["/{manifest["dist"]["name"]}"]' in dockerfile
    config = svc["command"][0].split("=", 1)[1]
    assert _mounted_config("otelcol", config) == ROOT / "config/otelcol.yaml"  # tests/test_scaleout.py's file


@pytest.mark.parametrize("replica", REPLICAS)
def test_replica_config_is_valid_and_matches_the_load_balancer_and_scrape_targets(replica):
    svc = SERVICES[replica]
    config_path = _mounted_config(replica, svc["command"][svc["command"].index("--config") + 1])
    cfg = load_config(config_path)  # our own validation: unknown keys or bad values fail here
    grpc_host, grpc_port = split_endpoint(cfg.receivers.grpc.endpoint)
    assert grpc_host == "0.0.0.0", "a replica must accept spans from the otelcol container"
    assert f"{replica}:{grpc_port}" in OTELCOL["exporters"]["load_balancing"]["resolver"]["static"]["hostnames"]
    targets = {t for job in PROMETHEUS["scrape_configs"] if job["job_name"] == "agenteval"
               for sc in job["static_configs"] for t in sc["targets"]}
    assert f"{replica}:{split_endpoint(cfg.exporters.prometheus.endpoint)[1]}" in targets
    out_host, _ = _host_port(cfg.exporters.otlp.endpoint)
    assert out_host in SERVICES and not cfg.exporters.otlp.push_metrics  # Jaeger takes traces only
    # One shared PostgreSQL history: the URL names the compose service, user and database, and the
    # password comes from the same variable the database is initialised with (never from the URL).
    db = conninfo_to_dict(cfg.store.url)
    postgres = SERVICES[db["host"]]["environment"]
    assert "password" not in db and cfg.store.password_env in svc["environment"]
    assert (db["user"], db["dbname"]) == (postgres["POSTGRES_USER"], postgres["POSTGRES_DB"])
    assert svc["environment"][cfg.store.password_env] == postgres["POSTGRES_PASSWORD"]
    assert svc["depends_on"][db["host"]]["condition"] == "service_healthy"
    assert svc["hostname"] == replica  # recorded on each run as finalized_by


def test_otelcol_routes_by_trace_id_to_every_replica_and_nowhere_else():
    lb = OTELCOL["exporters"]["load_balancing"]
    assert lb["routing_key"] == "traceID"
    hostnames = lb["resolver"]["static"]["hostnames"]
    assert sorted(h.split(":")[0] for h in hostnames) == REPLICAS
    assert OTELCOL["service"]["pipelines"]["traces"]["exporters"] == ["load_balancing"]
    for name, pipeline in OTELCOL["service"]["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                assert component in OTELCOL[kind], f"pipeline {name} uses undefined {kind[:-1]} {component}"
    for name, exporter in OTELCOL["exporters"].items():
        if "endpoint" in exporter:
            assert _host_port(exporter["endpoint"])[0] in SERVICES, f"{name} points outside the compose project"
    published = {int(p.split(":")[1]) for p in SERVICES["otelcol"]["ports"]}
    received = {_host_port(p["endpoint"])[1] for p in OTELCOL["receivers"]["otlp"]["protocols"].values()}
    assert received <= published
    telemetry_port = OTELCOL["service"]["telemetry"]["metrics"]["readers"][0]["pull"]["exporter"]["prometheus"]["port"]
    otel_targets = [t for job in PROMETHEUS["scrape_configs"] if job["job_name"] == "otelcol"
                    for sc in job["static_configs"] for t in sc["targets"]]
    assert otel_targets == [f"otelcol:{telemetry_port}"]


def test_prometheus_and_grafana_configs_point_at_real_services_and_files():
    for job in PROMETHEUS["scrape_configs"]:
        for sc in job["static_configs"]:
            for target in sc["targets"]:
                assert _host_port(target)[0] in SERVICES
    for rule_file in PROMETHEUS["rule_files"]:
        assert _mounted_config("prometheus", rule_file).exists()
    prom_config = SERVICES["prometheus"]["command"][0].split("=", 1)[1]
    assert _mounted_config("prometheus", prom_config) == ROOT / "config/prometheus.yml"
    source = yaml.safe_load(_mounted_config("grafana", "/etc/grafana/provisioning/datasources/prometheus.yaml").read_text())
    (datasource,) = source["datasources"]
    assert re.fullmatch(r"http://prometheus:9090", datasource["url"])
    provider = yaml.safe_load(_mounted_config("grafana", "/etc/grafana/provisioning/dashboards/agenteval.yaml").read_text())
    dashboards_dir = _mounted_config("grafana", provider["providers"][0]["options"]["path"])
    assert (dashboards_dir / "fidelity.json").exists()
    for panel in DASHBOARD["panels"]:
        assert panel["datasource"]["uid"] == datasource["uid"]


def test_alert_rules_cover_fail_pending_and_refused_spans():
    rules = [r for group in ALERTS["groups"] for r in group["rules"]]
    names = {r["alert"] for r in rules}
    assert {"FidelityFailRateHigh", "FidelityWorkflowFailing", "FidelityPendingRateHigh", "CollectorRefusingSpans"} <= names
    for rule in rules:
        assert rule["for"] and rule["labels"]["severity"] and rule["annotations"]["summary"]


def _dashboard_exprs() -> list[str]:
    return [t["expr"] for p in DASHBOARD["panels"] for t in p["targets"]]


def _metric_names(expr: str) -> set[str]:
    """Metric names an expression selects, from a real PromQL parse (Grafana variables filled in)."""
    ast = promql_parser.parse(expr.replace("$__rate_interval", "5m").replace("$__range", "6h"))
    names: set[str] = set()

    def visit(node, *_):
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)

    promql_parser.walk(ast, visit)
    assert names, f"no metric selected in {expr!r}"
    return names


def test_dashboard_has_the_panels_ops_asked_for():
    titles = " | ".join(p["title"].lower() for p in DASHBOARD["panels"])
    for wanted in ("runs by status", "pending rate", "notruth executors by reason", "score distribution",
                   "executor verdicts over time", "spans received / refused / rejected", "in flight",
                   "fail rate by workflow", "pending rate by workflow"):
        assert wanted in titles
    assert len({p["id"] for p in DASHBOARD["panels"]}) == len(DASHBOARD["panels"])


@pytest.fixture(scope="module")
def scraped(tmp_path_factory) -> set[str]:
    """Every sample name a running collector exports once it has seen each kind of event."""
    proc = CollectorProcess(tmp_path_factory.mktemp("scrape"), {"assembly": {"max_spans_in_flight": 200}})
    try:
        spans, ids = record([s for s, _, _ in SCENARIOS.values()])
        export_spans(proc, spans)
        for trace_id in ids:
            proc.run(trace_id)
        half = export_request(record([SCENARIOS["loop"][0]] * 8)[0]).SerializeToString()  # 168 spans
        assert post(proc.http, half)[0] == 200  # fits max_spans_in_flight (200) alone...
        again = export_request(record([SCENARIOS["loop"][0]] * 8)[0]).SerializeToString()
        assert post(proc.http, again)[0] == 503  # ...not beside the first, still in flight: retry later
        big, _ = record([SCENARIOS["loop"][0]] * 30)  # can never fit: not retryable
        assert post(proc.http, export_request(big).SerializeToString())[0] == 413
        bad = export_request(record([SCENARIOS["pass"][0]])[0])
        bad.resource_spans[0].scope_spans[0].spans[0].trace_id = b"short"  # unusable: rejected
        assert post(proc.http, bad.SerializeToString())[0] == 200
        assert post(proc.http, b"\xff not a request")[0] == 400  # rejected whole
        text = urllib.request.urlopen(proc.prometheus, timeout=5).read().decode()
    finally:
        proc.stop()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> dict[str, list]:
    """The samples of a collector that has seen nothing yet, by name."""
    proc = CollectorProcess(tmp_path_factory.mktemp("fresh"))
    try:
        text = urllib.request.urlopen(proc.prometheus, timeout=5).read().decode()
    finally:
        proc.stop()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


@pytest.mark.parametrize("rule", [r for g in ALERTS["groups"] for r in g["rules"]], ids=lambda r: r["alert"])
def test_every_alert_watches_series_a_fresh_collector_already_exports(rule, fresh):
    """A rate over no series is no data, not 0: an alert on a counter that appears only at its first
    event cannot tell "none yet" from "not scraped"."""
    missing = _metric_names(rule["expr"]) - set(fresh) - PROMETHEUS_OWN
    assert not missing, f"{rule['alert']} watches series a fresh collector does not export: {missing}"


def test_a_fresh_collector_says_what_runs_and_how_the_process_does(fresh):
    (info,) = fresh["agenteval_build_info"]
    assert info.value == 1 and info.labels["decoder"] in ("native", "python") and info.labels["version"]
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds"):
        assert fresh[name][0].value > 0, name
    assert {s.labels["status"] for s in fresh["fidelity_runs_total"]} == {"PASS", "WARN", "FAIL", "PENDING"}
    assert all(s.value == 0 for s in fresh["fidelity_runs_total"] + fresh["collector_spans_refused_total"])


@pytest.mark.parametrize("expr", _dashboard_exprs() + [r["expr"] for g in ALERTS["groups"] for r in g["rules"]])
def test_every_query_parses_and_uses_metrics_the_collector_exports(expr, scraped):
    missing = _metric_names(expr) - scraped - PROMETHEUS_OWN
    assert not missing, f"{expr!r} uses metrics the collector does not export: {missing}"
