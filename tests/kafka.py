"""A real Apache Kafka broker for the tests (docs/scale-out.md "Kafka, exact"): the jars `make kafka`
resolved from Maven Central (tools/kafka/kafka.sh), run in KRaft mode (one process, broker and
controller) on loopback ports chosen at run time, its data in a temporary directory."""

from __future__ import annotations

import base64
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools/kafka/kafka.sh"


def libs_path() -> Path:
    """Where `make kafka` puts the broker's jars (they may not be there yet)."""
    return Path(subprocess.run([str(SCRIPT), "path"], check=True, capture_output=True, text=True).stdout.strip())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KafkaBroker:
    """One KRaft broker + controller; :meth:`stop` and :meth:`start` again keep its ports and data
    (a broker outage), :meth:`destroy` removes everything."""

    def __init__(self, libs: Path) -> None:
        self.libs = libs
        self.root = Path(tempfile.mkdtemp(prefix="agenteval-kafka-"))
        self.port, controller = _free_port(), _free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.properties = self.root / "server.properties"
        self.properties.write_text("\n".join([
            "process.roles=broker,controller",
            "node.id=1",
            f"controller.quorum.voters=1@127.0.0.1:{controller}",
            f"listeners=PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{controller}",
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names=CONTROLLER",
            "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name=PLAINTEXT",
            f"log.dirs={self.root / 'data'}",
            "offsets.topic.replication.factor=1",
            "offsets.topic.num.partitions=4",
            "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1",
            "group.initial.rebalance.delay.ms=0",
            # a replica killed with SIGKILL leaves the group after its session timeout (the tests: 3 s)
            "group.min.session.timeout.ms=1000",
            "auto.create.topics.enable=false",
            "",
        ]))
        cluster = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        self._java("kafka.tools.StorageTool", "format", "-t", cluster, "-c", str(self.properties), wait=True)
        self.proc: subprocess.Popen | None = None
        self.start()

    def _java(self, main: str, *args: str, wait: bool = False) -> subprocess.Popen | None:
        command = ["java", "-Xms128m", "-Xmx512m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
                   "-cp", f"{self.libs}/*", main, *args]
        if wait:
            subprocess.run(command, check=True, capture_output=True, timeout=180, cwd=self.root)
            return None
        log = (self.root / "broker.log").open("a")
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=self.root)

    def start(self, timeout: float = 120.0) -> None:
        from confluent_kafka.admin import AdminClient

        self.proc = self._java("kafka.Kafka", str(self.properties))
        deadline = time.monotonic() + timeout
        admin = AdminClient(self.client())
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kafka exited {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if admin.list_topics(timeout=2).brokers:
                    return
            except Exception:  # not up yet
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"kafka did not start in {timeout:g} s:\n{self.log()[-3000:]}")
            time.sleep(0.2)

    def client(self) -> dict:
        """A librdkafka client's config for this broker (its connection errors to a quiet logger)."""
        return {"bootstrap.servers": self.bootstrap, "logger": logging.getLogger("kafka-test-client")}

    def log(self) -> str:
        path = self.root / "broker.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def create_topic(self, name: str, partitions: int) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient(self.client())
        for future in admin.create_topics([NewTopic(name, partitions, 1)]).values():
            future.result(60)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def destroy(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def broker_or_reason() -> tuple[KafkaBroker | None, str]:
    """A started broker, or why there is none (the jars or Java missing)."""
    libs = libs_path()
    if not (libs / ".complete").exists():
        return None, f"the Kafka broker is not resolved ({libs}): run `make kafka`"
    if shutil.which("java") is None:
        return None, "Java is not installed (the Kafka broker needs it): apt-get install openjdk-17-jre-headless"
    return KafkaBroker(libs), ""


def require(message: str) -> None:
    import pytest

    if os.environ.get("AGENTEVAL_REQUIRE_KAFKA"):
        pytest.fail(message)
    pytest.skip(message)
