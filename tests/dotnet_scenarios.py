"""Running the MAF .NET scenarios (instrumentation/dotnet/samples/FidelityScenarios) and holding what
they said the collector must conclude against what it stored: shared by the live scenarios
(tests/test_dotnet_live.py), the fixtures' capture (tests/fixtures/dotnet/capture.py), their replay
(tests/test_dotnet_replay.py) and the .NET page's test (tests/test_dotnet_docs.py)."""

from __future__ import annotations

import fcntl
import http.server
import json
import os
import re
import shutil
import subprocess
import threading
import urllib.request
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from llm_server import LLMServer, Reply

ROOT = Path(__file__).resolve().parent.parent
DOTNET_DIR = ROOT / "instrumentation" / "dotnet"
SCENARIOS_PROJECT = DOTNET_DIR / "samples" / "FidelityScenarios"
FIXTURES = Path(__file__).parent / "fixtures" / "dotnet"
#: Makefile MAF_DOTNET: the newest release served and the oldest that restores.
RELEASES = ("1.28.0", "1.20.0")
EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def dotnet_sdk() -> str:
    dotnet = shutil.which("dotnet")
    if dotnet is None:
        if os.environ.get("AGENTEVAL_REQUIRE_DOTNET"):
            pytest.fail("no .NET SDK (dotnet), and AGENTEVAL_REQUIRE_DOTNET is set")
        pytest.skip("no .NET SDK (dotnet): the captured .NET traces still run (tests/test_dotnet_replay.py)")
    return dotnet


def scenario_program(release: str) -> Path:
    """The scenarios built against one MAF release (once; test workers wait for each other's build)."""
    dotnet = dotnet_sdk()
    out = DOTNET_DIR / "bin" / release / "FidelityScenarios" / "Release" / "net10.0"
    with open(DOTNET_DIR / f".build-{release}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = subprocess.run([dotnet, "build", str(SCENARIOS_PROJECT), "-c", "Release", f"-p:MafVersion={release}",
                                "--nologo", "-v", "q"], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return out / "FidelityScenarios"


def scenario_names() -> list[str]:
    """The scenarios of the sample's source (its `list` needs a build: parametrizing must not)."""
    text = (SCENARIOS_PROJECT / "Scenarios.cs").read_text()
    return re.findall(r'^\s*Named\("([^"]+)"', text, re.MULTILINE)


class Capture:
    """An OTLP receiver on 127.0.0.1 for both transports that keeps each request's bytes as received;
    with ``forward`` (a collector), it passes each on, as it came and on the same transport, and
    answers with the collector's answer."""

    def __init__(self, forward: Any = None) -> None:
        self.requests: list[bytes] = []
        self._lock = threading.Lock()
        channel = grpc.insecure_channel(forward.grpc) if forward is not None else None
        self._channel = channel

        def keep(body: bytes, _context: object = None, transport: str = "grpc") -> bytes:
            with self._lock:
                self.requests.append(body)
            if forward is None:
                return b""  # an empty ExportTraceServiceResponse: everything accepted
            if transport == "grpc":
                return channel.unary_unary(EXPORT, request_serializer=None,
                                           response_deserializer=None)(body, timeout=30)
            request = urllib.request.Request(f"{forward.http}/v1/traces", data=body, method="POST",
                                             headers={"Content-Type": "application/x-protobuf"})
            with urllib.request.urlopen(request, timeout=30) as answer:
                return answer.read()

        handler = grpc.method_handlers_generic_handler("opentelemetry.proto.collector.trace.v1.TraceService", {
            "Export": grpc.unary_unary_rpc_method_handler(keep, request_deserializer=None, response_serializer=None)})
        self.grpc = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler])
        self.grpc_port = self.grpc.add_insecure_port("127.0.0.1:0")
        self.grpc.start()

        class Http(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path != "/v1/traces" or self.headers.get("Content-Encoding"):
                    self.send_error(400, f"unexpected {self.path} {self.headers.get('Content-Encoding')}")
                    return
                answer = keep(body, transport="http")
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Http)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def endpoint(self, transport: str) -> str:
        return (f"http://127.0.0.1:{self.grpc_port}" if transport == "grpc"
                else f"http://127.0.0.1:{self.http.server_address[1]}")

    def take(self) -> list[bytes]:
        with self._lock:
            taken, self.requests = self.requests, []
        return taken

    def close(self) -> None:
        self.grpc.stop(0)
        self.http.shutdown()
        if self._channel is not None:
            self._channel.close()


def run_scenario(program: Path, name: str, endpoint: str, transport: str, model_server: LLMServer) -> dict:
    """One scenario run (a model server scripted as the program says); its printed JSON."""
    script = json.loads(subprocess.run([str(program), "script", name], capture_output=True, text=True, check=True,
                                       timeout=60).stdout)
    for model, replies in script.items():
        model_server.script(model, [Reply(r["input_tokens"], r["output_tokens"], r["finish"]) for r in replies])
    proc = subprocess.run([str(program), name, "--endpoint", endpoint, "--protocol", transport,
                           "--openai", model_server.base_url], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} over {transport}: {proc.stderr[-3000:]}")
    if model_server.unplayed():
        raise RuntimeError(f"{name}: model server replies left unplayed: {model_server.unplayed()}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def capture(program: Path, name: str, transport: str, receiver: Capture,
            model_server: LLMServer) -> tuple[dict, list[bytes]]:
    said = run_scenario(program, name, receiver.endpoint(transport), transport, model_server)
    return said, receiver.take()



def units(run: dict) -> dict[str, dict]:
    return {e["executor_id"]: {
        "verdict": e["verdict"],
        "truth_tokens": e["evidence"]["truth_tokens"],
        "framework_tokens": e["evidence"]["framework_tokens"],
        "truth_finish": e["evidence"]["truth_finish"],
        "framework_finish": e["evidence"]["framework_finish"],
        "no_truth_reason": e.get("no_truth_reason"),
        "direction": e["evidence"]["direction"],
        "truth_cache_read_tokens": e["evidence"].get("truth_cache_read_tokens"),
        "truth_reasoning_tokens": e["evidence"].get("truth_reasoning_tokens"),
    } for e in run["executors"]}


def assert_runs(stored: list[dict], trace_ids: list[str], expected: list[list[dict]], release: str) -> None:
    """``expected``: per trace (in ``trace_ids``' order), its workflow runs in the order they started."""
    flat = [run for trace in expected for run in trace]
    assert len(stored) == len(flat), [(r["run_id"], r["status"]) for r in stored]
    ordered = sorted(stored, key=lambda r: (trace_ids.index(r["trace_id"]), r["started_at"]))
    for run, want in zip(ordered, flat, strict=True):
        got = units(run)
        if want.get("unordered"):  # agents started at once: which is unnamed-agent-2 is the run's to say
            assert sorted(got) == sorted(want["units"]), (run["run_id"], got, want["units"])
            got, want_units = ([json.dumps(u, sort_keys=True) for u in sorted(units.values(), key=str)]
                               for units in (got, want["units"]))
            assert sorted(got) == sorted(want_units), (run["run_id"], got, want_units)
        else:
            assert got == want["units"], (run["run_id"], got, want["units"])
        assert run["status"] == want["status"], run["run_id"]
        assert run["non_agent_executors"] == want["non_agent_executors"], run["run_id"]
        assert run["maf_release"] == (f"dotnet-{release}" if want["ledger"] else None), run["run_id"]
        assert run["runtime"] == "dotnet"


def shape(requests: list[bytes]) -> set[tuple]:
    """The kinds of span in export requests: (scope, name with per-process ids blanked, kind, attribute
    keys). Not how many of each: MAF ends a session with one or two idle ``invoke_workflow`` spans,
    as its threads happen to run."""
    found: set[tuple] = set()
    for body in requests:
        for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
            for ss in rs.scope_spans:
                for s in ss.spans:
                    found.add((ss.scope.name, re.sub(r"[0-9a-f]{32}", "{id}", s.name), s.kind,
                               tuple(sorted(a.key for a in s.attributes))))
    return found


def requests_in(folder: Path) -> list[bytes]:
    return [f.read_bytes() for f in sorted(folder.glob("*.pb"))]
