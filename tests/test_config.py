"""Configuration: the documented YAML is the embedded defaults; bad configs exit 1 naming the key."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from collector.profiles import EXECUTOR
from collector.config import CollectorConfig, ConfigError, load_config
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
    path.write_text("profiles:\n  custom:\n    executor_span_prefixes: [step.run]\n    chat_span_prefixes: ['llm.call']\n")
    matcher = load_config(path).matcher()
    assert matcher.kind("step.run planner") == EXECUTOR and matcher.is_chat("llm.call", {})
    assert matcher.kind("executor.process x") != EXECUTOR
