"""Our OpenTelemetry Collector distribution as a subprocess on loopback ports chosen at run time, for
tests/test_scaleout.py and bench/scaleout.py: the binary `make otelcol` built (where otelcol/path.sh
says) running config files such as config/otelcol.yaml, with its ports fed in through the same
environment variables docker-compose.yml leaves at their defaults."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent
#: What the collector logs once every pipeline is up.
READY = "Everything is ready"


def binary_path() -> Path:
    """Where `make otelcol` puts the binary of the current manifest (it may not be built yet)."""
    out = subprocess.run([str(HERE / "path.sh")], check=True, capture_output=True, text=True).stdout
    return Path(out.strip())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Otelcol:
    """The binary on ``configs`` (files, or ``yaml:`` overrides, merged in order): OTLP/gRPC at
    :attr:`grpc`, its own metrics at :attr:`metrics_url`, log at ``log``; ``env`` sets the config's
    other variables (replicas, Jaeger, retry pace)."""

    def __init__(self, configs: Sequence[Path | str], log: Path, env: dict[str, str],
                 wrap: Sequence[str] = ()) -> None:
        """``wrap``: a command that runs the binary (its arguments appended), e.g. one that gives it a
        mount namespace of its own."""
        self.grpc = f"127.0.0.1:{free_port()}"
        metrics_port = free_port()
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.log_path = log
        ports = {"OTELCOL_GRPC_ENDPOINT": self.grpc, "OTELCOL_HTTP_ENDPOINT": f"127.0.0.1:{free_port()}",
                 "OTELCOL_METRICS_HOST": "127.0.0.1", "OTELCOL_METRICS_PORT": str(metrics_port)}
        with log.open("w") as stderr:
            self.proc = subprocess.Popen([*wrap, str(binary_path()), *(f"--config={c}" for c in configs)],
                                         stdout=subprocess.DEVNULL, stderr=stderr, env={**os.environ, **ports, **env})
        deadline = time.monotonic() + 30
        while READY not in log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"otelcol did not start (exit {self.proc.returncode}):\n{log.read_text()[-3000:]}")
            time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        """Its own metrics (otelcol_*), each summed over its labels."""
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
