"""The scaled-out deployment, checked without a docker engine: docker-compose.yml, the OpenTelemetry
Collector, Prometheus and Grafana configs agree with each other and with what the collector exports."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import promql_parser
import pytest
import yaml
from dockerfile_parse import DockerfileParser
from prometheus_client.parser import text_string_to_metric_families
from psycopg.conninfo import conninfo_to_dict

from collector.config import load_config, split_endpoint
from collector.store import open_store

from conftest import CollectorProcess, export_spans, post
from mafshape import SCENARIOS, export_request, record

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
#: Our replicas are the services built from this repository's Dockerfile: behind the load balancer by
#: default, consuming Kafka in the `kafka` profile.
REPLICAS = sorted(name for name, svc in SERVICES.items() if svc.get("build") == "." and not svc.get("profiles"))
KAFKA_REPLICAS = sorted(name for name, svc in SERVICES.items()
                        if svc.get("build") == "." and "kafka" in svc.get("profiles", []))
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
        if line.startswith("COPY ") and "--from=" not in line:
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


@pytest.mark.parametrize("replica", KAFKA_REPLICAS)
def test_the_kafka_profile_replicas_consume_the_topic_its_load_balancer_writes(replica):
    svc = SERVICES[replica]
    cfg = load_config(_mounted_config(replica, svc["command"][svc["command"].index("--config") + 1]))
    kafka = cfg.receivers.kafka
    assert kafka.enabled and not cfg.journal.enabled and cfg.shutdown_delay == 0  # a consumer group needs no delay
    exporter = _resolved(yaml.safe_load((ROOT / "config/otelcol-kafka.yaml").read_text()), {})["exporters"]["kafka"]
    assert exporter["partition_traces_by_id"] and exporter["traces"]["encoding"] == "otlp_proto"
    assert exporter["traces"]["topic"] == kafka.topic
    assert [_host_port(b) for b in kafka.brokers] == [_host_port(b) for b in exporter["brokers"]]
    assert {_host_port(b)[0] for b in kafka.brokers} <= {n for n, s in SERVICES.items()
                                                          if "kafka" in s.get("profiles", [])}
    assert _mounted_config("otelcol-kafka", SERVICES["otelcol-kafka"]["command"][0].split("=", 1)[1]) == \
        ROOT / "config/otelcol-kafka.yaml"
    assert len({SERVICES[r]["hostname"] for r in KAFKA_REPLICAS}) == len(KAFKA_REPLICAS) >= 2


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
    source = yaml.safe_load(
        _mounted_config("grafana", "/etc/grafana/provisioning/datasources/prometheus.yaml").read_text())
    (datasource,) = source["datasources"]
    assert re.fullmatch(r"http://prometheus:9090", datasource["url"])
    provider = yaml.safe_load(
        _mounted_config("grafana", "/etc/grafana/provisioning/dashboards/agenteval.yaml").read_text())
    dashboards_dir = _mounted_config("grafana", provider["providers"][0]["options"]["path"])
    assert (dashboards_dir / "fidelity.json").exists()
    for panel in DASHBOARD["panels"]:
        assert panel["datasource"]["uid"] == datasource["uid"]


def test_alert_rules_cover_fail_pending_and_refused_spans():
    rules = [r for group in ALERTS["groups"] for r in group["rules"]]
    names = {r["alert"] for r in rules}
    assert {"FidelityFailRateHigh", "FidelityWorkflowFailing", "FidelityPendingRateHigh",
            "CollectorRefusingSpans"} <= names
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
    # the scenarios' model priced by hand, so an under-report adds to the unreported-cost counter
    proc = CollectorProcess(tmp_path_factory.mktemp("scrape"), {"assembly": {"max_spans_in_flight": 200}, "pricing": {
        "models": {"fake-model": {"input_per_mtok": 1.0, "output_per_mtok": 1.0}}}})
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


#: The verdict counters: their label values (each run's subject and MAF release) come from runs, so
#: a series appears with the first run that has it, never at 0 with a placeholder value no run has.
PER_RUN = {"agenteval_runs_total", "agenteval_unit_verdicts_total", "agenteval_notruth_units_total",
           "agenteval_overreported_units_total", "agenteval_unreported_tokens_total",
           "agenteval_unreported_cost_usd_total"}


@pytest.mark.parametrize("rule", [r for g in ALERTS["groups"] for r in g["rules"]
                                  if _metric_names(r["expr"]) - PER_RUN - PROMETHEUS_OWN], ids=lambda r: r["alert"])
def test_every_self_metric_alert_watches_series_a_fresh_collector_already_exports(rule, fresh):
    """A rate over no series is no data, not 0: an alert on a counter that appears only at its first
    event cannot tell "none yet" from "not scraped". Self-metrics' label values are known in advance."""
    missing = _metric_names(rule["expr"]) - set(fresh) - PROMETHEUS_OWN
    assert not missing, f"{rule['alert']} watches series a fresh collector does not export: {missing}"


def test_a_fresh_collector_exports_no_verdict_series_with_a_placeholder_label(fresh):
    """Before any run, the verdict counters carried subject="" and maf_release="unknown"."""
    assert not PER_RUN & set(fresh), PER_RUN & set(fresh)
    values = {v for samples in fresh.values() for s in samples for v in s.labels.values()}
    assert "" not in values and "unknown" not in values


def test_a_fresh_collector_says_what_runs_and_how_the_process_does(fresh):
    (info,) = fresh["agenteval_build_info"]
    assert info.value == 1 and info.labels["decoder"] in ("native", "python") and info.labels["version"]
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds"):
        assert fresh[name][0].value > 0, name
    assert {s.labels["reason"] for s in fresh["agenteval_spans_refused_total"]} == {"capacity", "journal",
                                                                                    "store_backlog"}
    assert all(s.value == 0 for s in fresh["agenteval_spans_refused_total"])


@pytest.mark.parametrize("expr", _dashboard_exprs() + [r["expr"] for g in ALERTS["groups"] for r in g["rules"]])
def test_every_query_parses_and_uses_metrics_the_collector_exports(expr, scraped):
    missing = _metric_names(expr) - scraped - PROMETHEUS_OWN
    assert not missing, f"{expr!r} uses metrics the collector does not export: {missing}"


# --- the container image, built without a container engine ---------------------------------------

#: The Dockerfile's runtime stage (its last): ARG defaults and ENV values resolved.
DOCKERFILE = DockerfileParser(path=str(ROOT / "Dockerfile"), env_replace=True)
RUNTIME = DOCKERFILE.structure[max(i for i, ins in enumerate(DOCKERFILE.structure) if ins["instruction"] == "FROM"):]
DATA_DIR = DOCKERFILE.args["DATA_DIR"]
UID = int(DOCKERFILE.args["UID"])


def _instruction(name: str) -> str:
    """The runtime stage's ``name`` instruction (there must be one), its ARGs substituted."""
    (value,) = [ins["value"] for ins in RUNTIME if ins["instruction"] == name]
    return re.sub(r"\$\{(\w+)\}", lambda m: DOCKERFILE.args[m.group(1)], value)


def _image_file(container_path: str) -> Path:
    """The repository file the runtime stage copies to ``container_path``."""
    for ins in RUNTIME:
        if ins["instruction"] == "COPY" and "--from=" not in ins["value"]:
            source, target = ins["value"].split()
            if target == container_path:
                return ROOT / source
    raise AssertionError(f"the image has no {container_path}")


#: The image's command line: ENTRYPOINT + CMD.
IMAGE_ARGV = json.loads(_instruction("ENTRYPOINT")) + json.loads(_instruction("CMD"))
IMAGE_CONFIG = _image_file(IMAGE_ARGV[IMAGE_ARGV.index("--config") + 1])


def test_the_image_runs_as_its_non_root_user_with_everything_it_writes_on_its_volume():
    assert _instruction("USER") == f"{UID}:{UID}" and UID != 0  # numeric: runAsNonRoot can check it
    assert _instruction("VOLUME") == DATA_DIR and DOCKERFILE.envs["HOME"] == DATA_DIR
    cfg = load_config(IMAGE_CONFIG)
    assert Path(cfg.store.url).parent == Path(cfg.journal.path).parent == Path(DATA_DIR)
    exposed = {int(p) for p in _instruction("EXPOSE").split()}
    ports = [split_endpoint(e) for e in (cfg.receivers.grpc.endpoint, cfg.receivers.http.endpoint,
                                         cfg.exporters.prometheus.endpoint)]
    assert all(host == "0.0.0.0" for host, _ in ports) and exposed == {port for _, port in ports}
    assert f"http://127.0.0.1:{ports[1][1]}/readyz" in _instruction("HEALTHCHECK")  # ready: replayed, store reachable
    # The compose replicas keep their journal on their own named volume, mounted on the data dir.
    for replica in REPLICAS:
        journal = load_config(_mounted_config(replica, "/etc/agenteval/collector.yaml")).journal.path
        volume = next(v.split(":")[0] for v in SERVICES[replica]["volumes"] if v.split(":")[1] == DATA_DIR)
        assert volume in COMPOSE["volumes"] and Path(journal).parent == Path(DATA_DIR)
    data_volumes = {v.split(":")[0] for r in REPLICAS for v in SERVICES[r]["volumes"] if v.split(":")[1] == DATA_DIR}
    assert len(data_volumes) == len(REPLICAS)  # a journal each


def test_the_dockerfiles_pass_hadolint():
    result = subprocess.run([str(Path(sys.executable).parent / "hadolint"), "--failure-threshold", "info",
                             "--no-color", "Dockerfile", "otelcol/Dockerfile"], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def shared_dir() -> Iterator[Path]:
    """A directory another user can traverse (pytest's own are private to this one)."""
    path = Path(tempfile.mkdtemp(prefix="agenteval-deploy-"))
    path.chmod(0o755)
    yield path
    for sub in path.rglob("*"):  # files made read-only below, so an unprivileged run can remove them
        if sub.is_dir() and not sub.is_symlink():
            sub.chmod(0o755)
    shutil.rmtree(path)


def _as_image_user() -> dict:
    """Popen arguments running a child as the image's user: its numeric UID:GID, with no passwd entry
    (as Kubernetes' runAsUser does) when the tests run as root, else as this (non-root) user."""
    return {"user": UID, "group": UID, "extra_groups": []} if os.geteuid() == 0 else {}


def _public_python() -> str:
    """A Python of the image's version (Dockerfile PYTHON_VERSION) that another user may run: every
    directory above it traversable (a pyenv under a private /root is not)."""
    name = "python" + re.search(r"^ARG PYTHON_VERSION=(\S+)", DOCKERFILE.content, re.M)[1]
    for directory in os.environ.get("PATH", "").split(":") + ["/usr/local/bin", "/usr/bin"]:
        path = Path(directory) / name
        if path.is_file() and all(os.stat(p).st_mode & 0o001 for p in path.resolve().parents):
            return str(path)
    pytest.skip(f"no {name} that another user can run (e.g. Debian's python3 package at that version)")


def _owned_by_image_user(path: Path) -> Path:
    path.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(path, UID, UID)
    return path


@dataclass
class Image:
    venv: Path
    config: Path
    data: Path


@pytest.fixture(scope="module")
def image(shared_dir: Path) -> Image:
    """The image's runtime stage, laid out here: a fresh environment holding what the Dockerfile
    installs (its own pip command, on the two wheels its build stage makes), not writable by the
    image's user; the image's config with its data directory moved to one that user owns."""
    python = _public_python()
    native = subprocess.run([str(ROOT / "tools/native-wheel"), python], capture_output=True, text=True)
    if native.returncode != 0:
        message = f"no compiled decoder (no Rust? offline without a prebuilt one?): {native.stderr.strip()[-300:]}"
        if os.environ.get("AGENTEVAL_REQUIRE_NATIVE"):
            pytest.fail(message)
        pytest.skip(message)
    wheels = shared_dir / "wheels"
    wheels.mkdir()
    shutil.copy(native.stdout.strip(), wheels)
    # The collector's wheel from what the build stage copies (not the work tree, whose build/ and
    # egg-info pip would otherwise leave behind).
    context = shared_dir / "context"
    context.mkdir()
    for ins in DOCKERFILE.structure:
        if ins["instruction"] == "COPY" and "--from=" not in ins["value"] and ins["value"].split()[0] in (
                "pyproject.toml", "collector"):
            *sources, _ = ins["value"].split()
            for source in sources:
                (shutil.copytree if (ROOT / source).is_dir() else shutil.copy)(ROOT / source, context / source)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(wheels),
                    str(context)], check=True)
    venv = shared_dir / "image"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    install = _instruction("RUN").split("pip install", 1)[1].split("&&", 1)[0]
    subprocess.run(f"{shlex.quote(str(venv / 'bin/pip'))} install --quiet {install.replace('/wheels/', f'{wheels}/')}",
                   shell=True, check=True)
    subprocess.run(["chmod", "-R", "a-w", str(venv)], check=True)
    data = _owned_by_image_user(shared_dir / "data")
    config = shared_dir / "collector.yaml"
    # Loopback and ports chosen at run time, as every test here; the rest is the image's file.
    config.write_text(IMAGE_CONFIG.read_text().replace(DATA_DIR, str(data))
                      .replace("0.0.0.0:4317", "127.0.0.1:0").replace("0.0.0.0:4318", "127.0.0.1:0")
                      .replace("0.0.0.0:9464", "127.0.0.1:0"))
    return Image(venv, config, data)


def _serve(argv: list[str], env: dict[str, str], log: Path) -> tuple[subprocess.Popen, dict | None]:
    """Start a collector as the image's user; its collector_listening event, or None if it exited."""
    with log.open("w") as stderr:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=stderr, **_as_image_user())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("{") and (event := json.loads(line)).get("event") == "collector_listening":
                return proc, event
        if proc.poll() is not None:
            return proc, None
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"the collector did not start: {log.read_text()[-2000:]}")


def test_the_image_layout_starts_as_its_user_with_the_compiled_decoder_and_stores_a_run(image, shared_dir):
    env = {"PATH": f"{image.venv / 'bin'}:/usr/bin:/bin",
           **{k: v.replace(DATA_DIR, str(image.data)) for k, v in DOCKERFILE.envs.items()}}
    argv = [str(image.venv / "bin" / IMAGE_ARGV[0]), *IMAGE_ARGV[1:-1], str(image.config)]
    log = shared_dir / "image.log"
    proc, listening = _serve(argv, env, log)
    try:
        assert listening, f"exited {proc.returncode}: {log.read_text()[-2000:]}"
        assert listening["decoder"] == "native"  # the build bench/ measured
        assert listening["journal"] == str(image.data / "journal")
        spans, (trace_id,) = record([SCENARIOS["pass"][0]])
        assert post(listening["http"], export_request(spans).SerializeToString())[0] == 200
        store = open_store(str(image.data / "runs.db"))
        deadline = time.monotonic() + 30
        while (doc := store.get_run(trace_id)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert doc is not None and doc["status"] == "PASS", log.read_text()[-2000:]
        # the image's HEALTHCHECK, run as docker runs it (exec form), on the port chosen here
        check = json.loads(_instruction("HEALTHCHECK").split("CMD", 1)[1])
        port = listening["http"].rsplit(":", 1)[1]
        healthy = subprocess.run([str(image.venv / "bin" / check[0]),
                                  *[a.replace(":4318/", f":{port}/") for a in check[1:]]],
                                 capture_output=True, text=True, timeout=30, env=env)
        assert healthy.returncode == 0, healthy.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-2000:]
    written = [p for p in image.data.rglob("*")]
    assert (image.data / "journal") in written
    if os.geteuid() == 0:
        assert all(p.stat().st_uid == UID for p in written)


def test_an_unwritable_journal_is_named_by_its_config_key(image, shared_dir):
    readonly = shared_dir / "readonly"
    readonly.mkdir(mode=0o555)
    data = _owned_by_image_user(shared_dir / "journal-data")
    config = shared_dir / "unwritable.yaml"
    config.write_text(yaml.safe_dump({
        "receivers": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": {"endpoint": "127.0.0.1:0"}},
        "exporters": {"prometheus": {"endpoint": "127.0.0.1:0"}},
        "store": {"url": str(data / "runs.db")}, "journal": {"path": str(readonly / "journal")}}))
    log = shared_dir / "unwritable.log"
    proc, listening = _serve([str(image.venv / "bin/agenteval"), "collector", "serve", "--config", str(config)],
                             {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}, log)
    if listening:
        proc.kill()
    assert proc.wait(timeout=30) == 1 and not listening
    assert f"journal.path: {readonly / 'journal'} is not writable (Permission denied)" in log.read_text()


# --- Kubernetes: the Helm chart, rendered offline and validated against the Kubernetes schemas ----------

CHART = ROOT / "deploy/helm/agenteval"
CHART_VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
NAMESPACE = "observability"
#: The Kubernetes release whose schemas the rendered objects are checked against (the newest the
#: installed kubernetes-validate carries).
KUBERNETES = kubernetes_validate.latest_version()
PG_URL = "postgresql://agenteval@db.example.internal:5432/agenteval"
VARIANTS = {
    "one replica, SQLite on its volume": {},
    "three replicas, PostgreSQL by URL, the chart's Secret": {
        "replicas": 3, "store": {"url": PG_URL, "password": "pw"}},
    "three replicas, PostgreSQL by URL, an existing Secret, ServiceMonitor, traces backend": {
        "replicas": 3, "store": {"url": PG_URL, "existingSecret": "agenteval-db", "existingSecretKey": "pg"},
        "serviceMonitor": {"enabled": True}, "otelcol": {"tracesEndpoint": "tempo.tracing:4317"},
        "collectorConfig": {"exporters": {"metric_subjects": 7}}},
}


def _built(script: list[str], make_target: str, require: str) -> Path:
    path = Path(subprocess.run(script, capture_output=True, text=True, check=True).stdout.strip())
    if not path.exists():
        message = f"{path.name} is not built ({path}): run `make {make_target}`"
        if os.environ.get(require):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def helm() -> Path:
    return _built([str(ROOT / "deploy/helm/helm.sh"), "path"], "helm", "AGENTEVAL_REQUIRE_HELM")


def _helm(helm: Path, command: str, values: dict) -> subprocess.CompletedProcess:
    """`helm template` or `helm lint --strict` of the chart as it is in the repository (no copy: what
    `helm install deploy/helm/agenteval` reads), offline, with ``values`` over its own."""
    args = ["template", "rel"] if command == "template" else ["lint", "--strict"]
    return subprocess.run([str(helm), *args, str(CHART), "--namespace", NAMESPACE, "-f", "-"],
                          input=yaml.safe_dump(values), capture_output=True, text=True)


def _objects(helm: Path, values: dict) -> dict[tuple[str, str], dict]:
    result = _helm(helm, "template", values)
    assert result.returncode == 0, result.stderr
    return {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(result.stdout) if o}


def _one(objects: dict[tuple[str, str], dict], kind: str, suffix: str = "") -> dict:
    (obj,) = [o for (k, name), o in objects.items() if k == kind and name.endswith(suffix or name)]
    return obj


@pytest.mark.parametrize("values", VARIANTS.values(), ids=VARIANTS.keys())
def test_the_chart_renders_objects_valid_against_the_kubernetes_schemas(helm, values):
    objects = _objects(helm, values)
    custom = []
    for obj in objects.values():
        try:
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            custom.append(obj)
    assert {o["kind"] for o in custom} <= {"ServiceMonitor"}
    services = {name: o for (kind, name), o in objects.items() if kind == "Service"}
    for monitor in custom:  # prometheus-operator's: each selects a Service whose ports it names
        (svc,) = [s for s in services.values()
                  if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
    assert len(custom) == (2 if values.get("serviceMonitor", {}).get("enabled") else 0)


@pytest.mark.parametrize("values", VARIANTS.values(), ids=VARIANTS.keys())
def test_the_replicas_run_the_image_with_their_journal_on_their_own_volume(helm, values, tmp_path):
    objects = _objects(helm, values)
    sts = _one(objects, "StatefulSet")
    headless = _one(objects, "Service", sts["spec"]["serviceName"])
    assert sts["spec"]["replicas"] == values.get("replicas", 1)
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    assert headless["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == IMAGE_ARGV[3:]  # the image's CMD, its ENTRYPOINT kept
    assert pod["securityContext"]["runAsUser"] == UID and pod["securityContext"]["runAsNonRoot"]
    assert container["securityContext"]["readOnlyRootFilesystem"]
    # The config the replicas read validates as ours, and keeps the journal on the claimed volume.
    config_path = Path(container["args"][1])
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (config_volume,) = [v for v in pod["volumes"] if mounts.get(v["name"]) == str(config_path.parent)]
    configmap = _one(objects, "ConfigMap", config_volume["configMap"]["name"])
    config_file = tmp_path / config_path.name
    config_file.write_text(configmap["data"][config_path.name])
    cfg = load_config(config_file)
    # behind the load balancer a stopping replica accepts until the ring has learnt it left, within its grace
    assert cfg.shutdown_delay == CHART_VALUES["shutdownDelay"] > 0
    assert pod["terminationGracePeriodSeconds"] >= cfg.shutdown_delay + 30
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert Path(cfg.journal.path).parent == Path(mounts[claim["metadata"]["name"]]) == Path(DATA_DIR)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert {split_endpoint(cfg.receivers.grpc.endpoint)[1], split_endpoint(cfg.receivers.http.endpoint)[1],
            split_endpoint(cfg.exporters.prometheus.endpoint)[1]} == set(ports.values())
    assert {p["name"]: p["port"] for p in headless["spec"]["ports"]} == ports
    assert container["livenessProbe"]["httpGet"] == CHART_VALUES["livenessProbe"]["httpGet"]
    assert container["livenessProbe"]["httpGet"]["port"] in ports
    assert container["readinessProbe"]["httpGet"]["port"] in ports
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    env = {e["name"]: e for e in container["env"]}
    assert env["AGENTEVAL_INSTANCE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    store = values.get("store", {})
    if not store:
        assert Path(cfg.store.url).parent == Path(DATA_DIR) and cfg.store.password_env is None
        return
    assert cfg.store.url == PG_URL
    secret_ref = env[cfg.store.password_env]["valueFrom"]["secretKeyRef"]
    if "existingSecret" in store:
        assert (secret_ref["name"], secret_ref["key"]) == (store["existingSecret"], store["existingSecretKey"])
    else:
        secret = _one(objects, "Secret", secret_ref["name"])
        assert secret["data"][secret_ref["key"]] == "cHc="  # base64 "pw"
    assert cfg.exporters.metric_subjects == \
        values.get("collectorConfig", {}).get("exporters", {}).get("metric_subjects", 100)


def _otelcol_config(objects: dict[tuple[str, str], dict]) -> tuple[dict, dict]:
    deployment = _one(objects, "Deployment", "-otelcol")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config_path = Path(container["args"][0].split("=", 1)[1])
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(config_path.parent))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    return deployment, yaml.safe_load(_one(objects, "ConfigMap", volume["configMap"]["name"])["data"][config_path.name])


@pytest.mark.parametrize("replicas", [1, 3])
def test_the_load_balancer_routes_by_trace_id_to_the_headless_service_it_may_watch(helm, replicas):
    objects = _objects(helm, {"replicas": replicas, "store": {"url": PG_URL}})
    sts = _one(objects, "StatefulSet")
    deployment, config = _otelcol_config(objects)
    lb = config["exporters"]["load_balancing"]
    assert lb["routing_key"] == "traceID"
    assert lb["resolver"]["k8s"]["service"] == f"{sts['spec']['serviceName']}.{NAMESPACE}"
    assert lb["resolver"]["k8s"]["ports"] == [CHART_VALUES["ports"]["grpc"]]
    # The per-replica queue and retry tested in tests/test_scaleout.py (config/otelcol.yaml), unchanged.
    assert lb["protocol"] == OTELCOL["exporters"]["load_balancing"]["protocol"]
    assert config["service"]["pipelines"]["traces"]["exporters"] == ["load_balancing"]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == SERVICES["otelcol"]["image"]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    binding = _one(objects, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    role = _one(objects, "Role", binding["roleRef"]["name"])
    assert {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"]} in role["rules"]


def test_our_otelcol_distribution_accepts_the_charts_config(helm, tmp_path):
    otelcol = _built([str(ROOT / "otelcol/path.sh")], "otelcol", "AGENTEVAL_REQUIRE_OTELCOL")
    _, config = _otelcol_config(_objects(helm, VARIANTS[list(VARIANTS)[2]]))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    result = subprocess.run([str(otelcol), "validate", f"--config={tmp_path / 'config.yaml'}"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


KAFKA_VALUES = {"replicas": 3, "store": {"url": PG_URL},
                "kafka": {"enabled": True, "brokers": ["kafka-0.kafka:9092", "kafka-1.kafka:9092"], "topic": "spans",
                          "consumer": {"session.timeout.ms": 10000}, "exporter": {"producer": {"compression": "zstd"}}}}


def test_with_kafka_the_load_balancer_writes_the_topic_the_replicas_consume_as_one_group(helm, tmp_path):
    objects = _objects(helm, KAFKA_VALUES)
    for obj in objects.values():
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)
    sts = _one(objects, "StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    config_path = Path(container["args"][1])
    config_file = tmp_path / config_path.name
    config_file.write_text(_one(objects, "ConfigMap", sts["metadata"]["name"])["data"][config_path.name])
    cfg = load_config(config_file)  # our own validation: the journal must be off with the kafka receiver
    kafka = cfg.receivers.kafka
    assert kafka.enabled and not cfg.journal.enabled
    assert (kafka.brokers, kafka.topic, kafka.group_id) == (KAFKA_VALUES["kafka"]["brokers"], "spans",
                                                            sts["metadata"]["name"])
    assert kafka.client == {"session.timeout.ms": 10000}
    _, config = _otelcol_config(objects)
    exporter = config["exporters"]["kafka"]
    assert exporter["brokers"] == kafka.brokers and exporter["traces"] == {"topic": "spans", "encoding": "otlp_proto"}
    assert exporter["partition_traces_by_id"] and exporter["producer"]["compression"] == "zstd"
    assert exporter["producer"]["required_acks"] == -1
    assert config["service"]["pipelines"]["traces"]["exporters"] == ["kafka"]
    assert "load_balancing" not in config["exporters"]
    assert not [kind for kind, _ in objects if kind in ("Role", "RoleBinding")]  # no resolver to grant a watch
    otelcol = _built([str(ROOT / "otelcol/path.sh")], "otelcol", "AGENTEVAL_REQUIRE_OTELCOL")
    (tmp_path / "otelcol.yaml").write_text(yaml.safe_dump(config))
    result = subprocess.run([str(otelcol), "validate", f"--config={tmp_path / 'otelcol.yaml'}"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("values", VARIANTS.values(), ids=VARIANTS.keys())
def test_helm_lint_finds_nothing_to_warn_about(helm, values):
    """--strict: a warning (e.g. a listed dependency missing from charts/) fails the lint."""
    result = _helm(helm, "lint", values)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("values", "error"), [
    ({"replicas": 3}, "replicas > 1 need one shared PostgreSQL store: set store.url"),
    ({"store": {"url": "postgresql://agenteval:secret@db:5432/agenteval"}}, "store.url: has a password"),
    ({"store": {"url": "/var/lib/agenteval/runs.db"}}, "store.url: expected postgresql://"),
    ({"store": {"url": PG_URL, "password": "pw", "existingSecret": "agenteval-db"}}, "not both"),
    ({"store": {"existingSecret": "agenteval-db"}}, "store.existingSecret: needs store.url"),
    ({"store": {"password": "pw"}}, "store.password: needs store.url"),
    ({"kafka": {"enabled": True}}, "kafka.brokers: give the Kafka bootstrap servers"),
])
def test_the_chart_refuses_a_setup_that_cannot_work(helm, values, error):
    result = _helm(helm, "template", values)
    assert result.returncode != 0 and error in result.stderr, result.stderr
