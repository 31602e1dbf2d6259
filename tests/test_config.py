"""Configuration: the documented YAML is the embedded defaults; bad configs exit 1 naming the key."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from collector.config import CollectorConfig, ConfigError, load_config
from collector.core.profiles import EXECUTOR

from conftest import AGENTEVAL
from test_cli import ROOT

DOC = ROOT / "config" / "collector.yaml"


def leaves(value, prefix=""):
    if isinstance(value, dict) and value:
        for key, child in value.items():
            yield from leaves(child, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix


def test_documented_config_equals_the_embedded_defaults():
    assert load_config(DOC) == CollectorConfig()
    assert set(leaves(yaml.safe_load(DOC.read_text()))) == set(leaves(CollectorConfig().model_dump()))


def test_defaults_bind_loopback_only():
    cfg = CollectorConfig()
    for endpoint in (cfg.receivers.grpc.endpoint, cfg.receivers.http.endpoint, cfg.exporters.prometheus.endpoint):
        assert endpoint.startswith("127.0.0.1:")


@pytest.mark.parametrize("text,named", [
    ("assembly:\n  quiet_perod: 1\n", "assembly.quiet_perod: unknown key"),
    ("receivers:\n  grpc:\n    endpoint: nowhere\n", "receivers.grpc.endpoint"),
    ("scoring:\n  tolerance: -1\n", "scoring.tolerance"),
    ("scoring:\n  preset: extreme\n", "scoring.preset"),
    ("profiles:\n  mine:\n    chat_span_prefix: [x]\n", "profiles.mine.chat_span_prefix: unknown key"),
])
def test_bad_config_names_the_key(tmp_path, text, named):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=named.replace(".", r"\.").replace("[", r"\[")):
        load_config(path)
    proc = subprocess.run([AGENTEVAL, "collector", "serve", "--config", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and named in proc.stderr


def test_profiles_are_data_a_user_can_extend(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("profiles:\n  custom:\n    executor_span_prefixes: [step.run]\n"
                    "    chat_span_prefixes: ['llm.call']\n")
    matcher = load_config(path).matcher()
    assert matcher.kind("step.run planner") == EXECUTOR and matcher.is_chat("llm.call", {})
    assert matcher.kind("executor.process x") != EXECUTOR


def test_environment_references_are_resolved_in_any_value_before_validation(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPC_EP", "127.0.0.1:14317")
    monkeypatch.setenv("WAIT", "7.5")
    monkeypatch.delenv("NOT_SET", raising=False)
    path = tmp_path / "c.yaml"
    path.write_text("receivers:\n  grpc:\n    endpoint: ${env:GRPC_EP}\n"
                    "assembly:\n  max_trace_wait: ${env:WAIT}\n"  # one reference alone: read as YAML, a number
                    "store:\n  url: ${env:NOT_SET:-/data/runs.db}\n"
                    "exporters:\n  prometheus:\n    endpoint: 127.0.0.1:${env:NOT_SET:-19464}\n"
                    "profiles:\n  maf-python:\n    sdk_languages: [python, 'cost$$ly']\n")
    cfg = load_config(path)
    assert cfg.receivers.grpc.endpoint == "127.0.0.1:14317" and cfg.assembly.max_trace_wait == 7.5
    assert cfg.store.url == "/data/runs.db" and cfg.exporters.prometheus.endpoint == "127.0.0.1:19464"
    assert cfg.profiles["maf-python"].sdk_languages == ["python", "cost$ly"]  # $$ is a literal $
    path.write_text("receivers:\n  http:\n    endpoint: ${env:NOT_SET}\n")
    with pytest.raises(ConfigError, match=r"receivers\.http\.endpoint: \$\{env:NOT_SET\} is not set"):
        load_config(path)


def test_a_collector_started_on_a_config_of_environment_references_listens_there(tmp_path):
    from conftest import CollectorProcess, free_port

    grpc_port = free_port()
    proc = CollectorProcess(tmp_path, overrides={"receivers": {"grpc": {"endpoint": "${env:AGENTEVAL_TEST_GRPC}"}}},
                            env={"AGENTEVAL_TEST_GRPC": f"127.0.0.1:{grpc_port}"})
    try:
        assert proc.grpc == f"127.0.0.1:{grpc_port}"
    finally:
        assert proc.stop() == 0


def test_finish_aliases_given_are_added_to_the_shipped_map(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("scoring:\n  finish_aliases:\n    Done: STOP\n    load: load\n")
    aliases = dict(load_config(path).scoring.policy().finish_aliases)
    assert aliases["done"] == "stop" and aliases["end_turn"] == "stop"  # a vendor's kept
    assert aliases["load"] == "load"  # one dropped by mapping it to itself


@pytest.mark.parametrize(("section", "message"), [
    ({"ui": {"trace_url": 'http://grafana:3000/explore?left={"query":"{trace_id}"}'}},
     r"ui\.trace_url.*only \{trace_id\} and \{span_id\} may be in braces"),
    ({"ui": {"trace_url": "http://localhost:16686/search"}}, r"ui\.trace_url.*must contain \{trace_id\}"),
    ({"receivers": {"http": {"trace_link": "http://localhost:16686/trace/{trace_id}"}}},
     r"receivers\.http.*trace_link is now ui\.trace_url")])
def test_a_trace_url_the_run_page_could_not_fill_is_refused_naming_the_key(tmp_path, section, message):
    path = tmp_path / "collector.yaml"
    path.write_text(yaml.safe_dump(section))
    with pytest.raises(ConfigError, match=message):
        load_config(path)
