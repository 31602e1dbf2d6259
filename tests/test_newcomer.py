"""A newcomer's first hour: the CLI as a subprocess (or on a pseudo-terminal), the way users meet it.

Ports are always chosen at run time on 127.0.0.1, so all of this passes while `make run` is up.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import time
from pathlib import Path

import grpc
import jsonschema
import pytest
import yaml

from collector.api.v1 import fidelity_pb2 as pb
from collector.api.v1.fidelity_pb2_grpc import FidelityServiceStub
from collector.core.reconcile import reconcile
from collector.formats.loader import workflow_trace_run
from collector.store import StoredRun, open_store

from conftest import AGENTEVAL, CollectorProcess, export_spans
from mafshape import SCENARIOS, record, run_id
from test_cli import ROOT, bench
from test_stream import _wait_watchers

RUN_SCHEMA = json.loads((ROOT / "collector/formats/schemas/run.schema.json").read_text())


def cli(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([AGENTEVAL, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})}, **kw)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    proc = CollectorProcess(tmp_path_factory.mktemp("newcomer"))
    yield proc
    proc.stop()


def _serve(tmp_path: Path, cfg: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"store": {"url": str(tmp_path / "runs.db")}, **cfg}))
    return cli("collector", "serve", "--config", str(path))


# --- 1, 2: ports ---------------------------------------------------------------------------------

def test_a_config_error_is_reported_before_any_port_is_tried(live, tmp_path):
    """The reporter's `make test` beside `make run`: the token error, not 'Address already in use'."""
    proc = _serve(tmp_path, {"receivers": {"grpc": {"endpoint": live.grpc},
                                           "auth": {"bearer_token_env": "AGENTEVAL_NOT_SET_ANYWHERE"}}})
    assert proc.returncode == 1
    assert "receivers.auth.bearer_token_env: $AGENTEVAL_NOT_SET_ANYWHERE is not set" in proc.stderr
    assert "in use" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("key", ["receivers.grpc.endpoint", "receivers.http.endpoint", "exporters.prometheus.endpoint"])
def test_a_port_in_use_names_the_address_and_its_key(key, live, tmp_path):
    taken = {"receivers.grpc.endpoint": live.grpc, "receivers.http.endpoint": live.http.removeprefix("http://"),
             "exporters.prometheus.endpoint": live.listening["prometheus"]}[key]
    cfg = {"receivers": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": {"endpoint": "127.0.0.1:0"}},
           "exporters": {"prometheus": {"endpoint": "127.0.0.1:0"}}}
    section, sub, _ = key.split(".")
    cfg[section][sub]["endpoint"] = taken
    proc = _serve(tmp_path, cfg)
    assert proc.returncode == 1
    assert f"{key}: {taken} is already in use" in proc.stderr and f"set {key} to a free port" in proc.stderr
    assert "Errno" not in proc.stderr and "Traceback" not in proc.stderr and "add_port" not in proc.stderr


# --- 5: watch --count and replay ------------------------------------------------------------------

def test_watch_count_counts_new_verdicts_not_replayed_ones(live):
    old, (old_tid,) = record([SCENARIOS["pass"][0]])
    export_spans(live, old)
    live.run(old_tid)
    watcher = subprocess.Popen([AGENTEVAL, "watch", "--endpoint", live.grpc, "--count", "1", "--replay", "1",
                                "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = watcher.stdout.readline()  # the replayed run is shown ...
        assert json.loads(line)["run_id"] == run_id(old_tid)
        time.sleep(0.5)
        assert watcher.poll() is None  # ... but not counted
        new, (new_tid,) = record([SCENARIOS["fail_under_report"][0]])
        export_spans(live, new)
        out, _ = watcher.communicate(timeout=30)
    finally:
        watcher.kill()
    assert watcher.returncode == 0
    last = json.loads(out.strip().splitlines()[-1])
    assert (last["run_id"], last["status"]) == (run_id(new_tid), "FAIL")
    help_text = cli("watch", "--help").stdout
    assert "new verdicts" in " ".join(help_text.split())


# --- 6: an ambiguous id prefix --------------------------------------------------------------------

def _store_runs(path: Path, ids: list[str]) -> None:
    doc = json.loads((ROOT / "examples/pass_all_agree.json").read_text())
    verdict = reconcile(workflow_trace_run(doc, "x"))
    store = open_store(path)
    try:
        store.save_many([StoredRun(i, "file:x", verdict) for i in ids])
    finally:
        store.close()


def test_an_ambiguous_prefix_says_so_and_lists_the_matches(tmp_path):
    db = tmp_path / "r.db"
    _store_runs(db, ["5a01", "5b02", "5c03", "5d04", "77aa"])
    proc = cli("runs", "show", "5", "--store", str(db))
    assert proc.returncode == 1
    assert "'5' matches several runs (5a01, 5b02, 5c03 and more): give more characters" in proc.stderr
    proc = cli("runs", "show", "9", "--store", str(db))
    assert "no run '9' in" in proc.stderr and "agenteval runs list" in proc.stderr
    assert cli("runs", "show", "77", "--store", str(db)).returncode == 0


def test_get_run_says_when_a_prefix_is_ambiguous(live):
    # not hex: no run another test stored in the shared collector can share the prefix
    _store_runs(live.store_path, ["zz01", "zz02"])
    with grpc.insecure_channel(live.grpc) as channel, pytest.raises(grpc.RpcError) as caught:
        FidelityServiceStub(channel).GetRun(pb.GetRunRequest(run_id="zz"))
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND
    assert "'zz' matches several runs (zz01, zz02)" in caught.value.details()


# --- 8: help text ---------------------------------------------------------------------------------

#: Every command and group, as `--help` is asked of them.
ALL_HELP = [(), ("bench",), ("runs",), ("collector",), ("bench", "workflow-trace-fidelity"), ("runs", "list"),
            ("runs", "show"), ("watch",), ("demo",), ("collector", "serve")]


def test_top_level_help_shows_each_command_description_whole():
    """At 80 columns, `agenteval --help` cut `demo` and `watch` short with "...". """
    from typer.main import get_command

    from collector.ui.cli import app

    for path in [(), ("bench",), ("runs",), ("collector",)]:
        text = cli(*path, "--help", env={"COLUMNS": "80"}).stdout
        assert "..." not in text.split("Commands:")[1], path
        group = get_command(app)
        for name in path:
            group = group.commands[name]
        for name, command in group.commands.items():
            first = (command.help or "").split("\n\n")[0]
            assert " ".join(first.split()) in " ".join(text.split()), (path, name)


@pytest.mark.parametrize("command", ALL_HELP)
def test_help_names_values_not_python_types(command):
    """`--status <list[str]>`, `--store <str>`, `--limit <int range>`: Python's words, not the user's."""
    text = cli(*command, "--help", env={"COLUMNS": "100"}).stdout
    leaked = [m for m in re.findall(r"<([^>]*)>", text)
              if re.search(r"\b(str|int|float|bool|list|range)\b|\[", m)]
    assert not leaked, leaked


@pytest.mark.parametrize("command", [("bench", "workflow-trace-fidelity"), ("runs", "list"), ("runs", "show"),
                                     ("watch",), ("demo",), ("collector", "serve")])
def test_help_shows_flags_as_flags_and_whole_sentences(command):
    proc = cli(*command, "--help", env={"COLUMNS": "80"})
    assert proc.returncode == 0
    assert "<bool>" not in proc.stdout
    for line in proc.stdout.splitlines():
        assert len(line) <= 80, line
    if command[0] == "bench":
        assert "--preset <smoke|standard|audit-grade>" in proc.stdout  # one piece, not split over lines
        assert "so memory stays flat however large the file." in " ".join(proc.stdout.split())
        assert "an\n  offline check never lands among a live collector's runs." in proc.stdout


# --- 10: input checks -----------------------------------------------------------------------------

def _v1(tmp_path: Path, executor_id: str, tokens: int = 100) -> Path:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({
        "schema": "workflow-trace/v1",
        "steps": [{"executor_id": executor_id, "input_tokens": tokens, "output_tokens": 0, "finish_reason": "stop"}],
        "executor_traces": {executor_id: {"turns": [
            {"kind": "response", "input_tokens": 100, "output_tokens": 0, "finish_reason": "stop"}]}}}))
    return path


def test_absurd_token_counts_are_an_error_naming_the_field(tmp_path):
    proc = bench(_v1(tmp_path, "writer", 10**32), tmp_path / "r.db")
    assert proc.returncode == 1
    assert "$.steps[0].input_tokens" in proc.stderr and "maximum of 1000000000000" in proc.stderr


def test_invisible_and_reordering_characters_in_ids_are_shown_escaped(tmp_path):
    proc = bench(_v1(tmp_path, "wri\u202eter\x00[red]x[/]"), tmp_path / "r.db")
    assert proc.returncode == 0, proc.stderr
    assert "\u202e" not in proc.stdout and "\x00" not in proc.stdout
    assert "wri\\u202eter\\u0000[red]x[/]" in proc.stdout  # escaped, and markup shown as typed


def test_an_empty_subject_is_refused(tmp_path):
    proc = bench(ROOT / "examples/pass_all_agree.json", tmp_path / "r.db", "--subject", " ")
    assert proc.returncode == 1 and "--subject: empty" in proc.stderr
    listed = cli("runs", "list", "--subject", "", "--store", str(tmp_path / "r.db"))
    assert listed.returncode == 1 and "--subject" in listed.stderr


def test_the_next_steps_printed_name_the_store_given_and_an_empty_filter_says_so(tmp_path):
    db = tmp_path / "mine.db"
    proc = cli("bench", "workflow-trace-fidelity", "--workflow-trace", str(ROOT / "examples/pass_all_agree.json"),
               "--subject", "s", "--store", str(db))
    assert proc.returncode == 0 and f"(`agenteval runs list --store {db}`)" in " ".join(proc.stderr.split())
    assert cli("runs", "list", "--store", str(db)).stdout.count("PASS") == 1  # the hint, as printed, works
    assert cli("runs", "list", "--subject", "other", "--store", str(db)).stdout.strip() == \
        "no stored run matches --subject other"  # the filters given, as given


def test_reading_a_store_that_is_not_there_is_an_error_not_an_empty_store(tmp_path):
    for command in (["runs", "list"], ["runs", "show", "abc"]):
        proc = cli(*command, "--store", str(tmp_path / "typo.db"))
        assert proc.returncode == 1 and f"{tmp_path / 'typo.db'}: no store there" in proc.stderr
        assert not (tmp_path / "typo.db").exists()


def test_a_store_path_in_a_missing_directory_is_refused_not_created(tmp_path):
    proc = bench(ROOT / "examples/pass_all_agree.json", tmp_path / "typo" / "dir" / "x.db")
    assert proc.returncode == 1
    assert f"directory {tmp_path / 'typo' / 'dir'} does not exist" in proc.stderr
    assert not (tmp_path / "typo").exists()


# --- 11: one JSON shape ---------------------------------------------------------------------------

def test_every_json_output_is_one_run_shape(live, tmp_path):
    validator = jsonschema.Draft202012Validator(RUN_SCHEMA)
    spans, (tid,) = record([SCENARIOS["finish_mismatch"][0]])
    watcher = subprocess.Popen([AGENTEVAL, "watch", "--endpoint", live.grpc, "--count", "1", "--replay", "0",
                                "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_watchers(live, 1)
        export_spans(live, spans)
        streamed = json.loads(watcher.communicate(timeout=30)[0].strip().splitlines()[-1])
    finally:
        watcher.kill()
    db = str(live.store_path)
    benched = json.loads(bench(ROOT / "examples/warn_partial_truth.json", live.store_path, "--json").stdout)["runs"][0]
    listed = json.loads(cli("runs", "list", "--json", "--store", db).stdout)
    shown = json.loads(cli("runs", "show", run_id(tid), "--json", "--store", db).stdout)
    docs = {"watch": streamed, "bench": benched, "list": listed[0], "show": shown}
    for name, doc in docs.items():
        errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(doc)]
        assert not errors, (name, errors)
        assert doc["incomplete"] is False
    assert len({tuple(sorted(d)) for d in docs.values()}) == 1
    assert all(validator.is_valid(d) for d in listed)
    assert streamed["run_id"] == shown["run_id"] and streamed["executors"] == shown["executors"]


# --- 9: watch on an 80-column terminal ------------------------------------------------------------

def test_watch_on_an_80_column_terminal_shows_whole_fields(live):
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "80", "LINES": "40", "TERM": "xterm"}
    watcher = subprocess.Popen([AGENTEVAL, "watch", "--endpoint", live.grpc, "--count", "1", "--replay", "0"],
                               stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    out = b""
    try:
        _wait_watchers(live, 1)
        spans, (tid,) = record([SCENARIOS["path2_pending"][0]], service="triage")
        export_spans(live, spans)
        deadline = time.monotonic() + 30
        while watcher.poll() is None and time.monotonic() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    out += os.read(master, 65536)
                except OSError:
                    break
    finally:
        watcher.kill()
        os.close(master)
    text = out.decode(errors="replace")
    assert "…" not in text
    assert "PENDING" in text
    assert "response_missing" in text.replace("\r", "").replace("\n", "").replace("│", "").replace(" ", "")


# --- 9: a quiet install ---------------------------------------------------------------------------

def _package_index_reachable(pip: Path) -> bool:
    """pip builds in isolation, fetching the build backend (setuptools) from the package index."""
    try:
        found = subprocess.run([str(pip), "index", "versions", "setuptools"], capture_output=True, text=True,
                               timeout=30)
    except subprocess.TimeoutExpired:
        return False
    return found.returncode == 0


def test_installing_as_make_does_prints_no_warning_box(tmp_path):
    """`make install`'s pip line (without the dependencies, already tested by every other test)."""
    venv = tmp_path / "venv"
    subprocess.run([os.sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    if not _package_index_reachable(venv / "bin" / "pip"):
        if os.environ.get("AGENTEVAL_REQUIRE_INDEX"):
            pytest.fail("the package index is unreachable, and AGENTEVAL_REQUIRE_INDEX is set (CI)")
        pytest.skip("the package index is unreachable: pip cannot fetch setuptools to build the packages")
    proc = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", "--no-deps",
                           str(ROOT / "instrumentation/opentelemetry-instrumentation-maf-fidelity"), "-e", str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Editable installation" not in proc.stderr and "*****" not in proc.stderr, proc.stderr
    found = subprocess.run([str(venv / "bin" / "python"), "-c", "import collector, importlib.util as u; print("
                            "collector.__file__, u.find_spec('opentelemetry.instrumentation.maf_fidelity') "
                            "is not None)"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert found.stdout.split() == [str(ROOT / "collector" / "__init__.py"), "True"], found.stderr


# --- errors: the thing named, what to do, never a traceback -----------------------------------------

@pytest.mark.parametrize(("args", "expected"), [
    (("watch", "--ca-file", "{tmp}/nope.pem"), "--ca-file {tmp}/nope.pem: no such file"),
    (("watch", "--endpoint", "not a host"), "--endpoint: expected host:port, got 'not a host'"),
    (("watch", "--endpoint", "http://127.0.0.1:4317"), "--endpoint: 'http://127.0.0.1:4317' is a URL"),
    (("runs", "list", "--store", "{tmp}"), "{tmp}: is a directory: the SQLite store is a file"),
    (("runs", "list", "--config", "{tmp}/nope.yaml"), "{tmp}/nope.yaml: No such file or directory"),
    (("collector", "serve", "--config", "{tmp}/bad.yaml"), "receivers.grpc.endpoint: Value error, expected host:port"),
    (("bench", "workflow-trace-fidelity", "--workflow-trace", "{tmp}/none.json", "--subject", "s", "--store",
      "{tmp}/r.db"), "{tmp}/none.json: no such file"),
    (("runs", "show", "nothing-here", "--store", "{tmp}/r.db"), "no run 'nothing-here' in {tmp}/r.db"),
])
def test_expected_conditions_are_one_clear_line(args, expected, tmp_path):
    (tmp_path / "bad.yaml").write_text("receivers: {grpc: {endpoint: nope}}\n")
    open_store(tmp_path / "r.db").close()  # an existing, empty store
    proc = cli(*(a.format(tmp=tmp_path) for a in args))
    assert proc.returncode == 1
    assert expected.format(tmp=tmp_path) in proc.stderr
    assert "Traceback" not in proc.stderr and "╭" not in proc.stderr


# --- from a newcomer's trial on a fresh clone ---------------------------------------------------------

def test_watch_with_nothing_listening_says_so_at_once_naming_the_address():
    """A closed port was silent for the first attempt's 5 s, then blamed a timeout, not the refusal."""
    from conftest import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([AGENTEVAL, "watch", "--endpoint", endpoint], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        first, second = proc.stderr.readline(), proc.stderr.readline()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert first.startswith(f"connecting to {endpoint}")
    assert f"no collector answering at {endpoint}" in second and "agenteval collector serve" in second
    assert "Connection refused" in second and "no answer within" not in second


def test_runs_list_takes_several_statuses(tmp_path):
    db = tmp_path / "r.db"
    for example in ("pass_all_agree", "fail_both", "warn_partial_truth"):
        bench(ROOT / f"examples/{example}.json", db)
    rows = json.loads(cli("runs", "list", "--status", "FAIL", "--status", "warn", "--json", "--store", str(db)).stdout)
    assert sorted(r["status"] for r in rows) == ["FAIL", "WARN"]


def test_bench_json_keeps_its_envelope_when_the_store_cannot_open(tmp_path):
    proc = bench(ROOT / "examples/pass_all_agree.json", tmp_path / "no" / "such" / "x.db", "--json")
    assert proc.returncode == 1
    out = json.loads(proc.stdout)
    assert out["runs"] == [] and out["exit_code"] == 1 and "does not exist" in out["error"]


def test_piped_output_respects_columns(tmp_path):
    proc = cli("bench", "workflow-trace-fidelity", "--workflow-trace", str(ROOT / "examples/warn_partial_truth.json"),
               "--subject", "s", "--store", str(tmp_path / "r.db"), env={"COLUMNS": "100"})
    assert max(len(line) for line in proc.stdout.splitlines()) <= 100


def _listed_lines(store: Path, columns: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns:
        env["COLUMNS"] = columns
    proc = subprocess.run([AGENTEVAL, "runs", "list", "--store", str(store)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_runs_list_piped_keeps_each_run_id_on_one_line(live, tmp_path):
    """`runs list | cat` folded the ids (a live run's is 49 characters) over two or three lines."""
    spans, (tid,) = record([SCENARIOS["fail_under_report"][0]], service="billing")
    export_spans(live, spans)
    live.run(tid)
    bench(ROOT / "examples/warn_partial_truth.json", live.store_path)  # a run id apart from its trace id
    ids = [r["run_id"] for r in json.loads(cli("runs", "list", "--json", "--store", str(live.store_path)).stdout)]
    assert run_id(tid) in ids and len(ids) >= 2
    lines = _listed_lines(live.store_path, None)  # piped: 160 columns
    for i in ids:
        assert any(i in line for line in lines), i
    # narrower than an id and the rest: a prefix `runs show` takes, on one line
    narrow = _listed_lines(live.store_path, "80")
    assert all(len(line) <= 80 for line in narrow)
    shown = {cell.split()[0] for line in narrow for cell in line.split("│")[1:2] if cell.strip()}
    for i in ids:
        prefixes = [s for s in shown if i.startswith(s)]
        assert len(prefixes) == 1 and [j for j in ids if j.startswith(prefixes[0])] == [i], (i, shown)


# --- collector validate: the config check that starts nothing -----------------------------------------

def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _shadow_confluent_kafka(tmp_path: Path) -> dict:
    """An environment in which confluent-kafka (the kafka extra) is not installed."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "confluent_kafka.py").write_text("raise ImportError('No module named confluent_kafka')\n")
    return {"PYTHONPATH": str(shadow)}


_FREE = {"receivers": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": {"endpoint": "127.0.0.1:0"}},
         "exporters": {"prometheus": {"endpoint": "127.0.0.1:0"}}}


@pytest.mark.parametrize(("cfg", "expected"), [
    ({"receivers": {"grpc": {"endpoint": "nope"}}}, "receivers.grpc.endpoint: Value error, expected host:port"),
    ({"assembly": {"quiet_periodd": 1}}, "assembly.quiet_periodd: unknown key"),
    ({"receivers": {"auth": {"bearer_token_env": "AGENTEVAL_NOT_SET_ANYWHERE"}}},
     "receivers.auth.bearer_token_env: $AGENTEVAL_NOT_SET_ANYWHERE is not set"),
    ({"exporters": {"prometheus": {"require_auth": True, "endpoint": "127.0.0.1:0"}}},
     "exporters.prometheus.require_auth: set receivers.auth.bearer_token_file"),
    ({"receivers": {"tls": {"cert_file": "{tmp}/none.pem", "key_file": "{tmp}/none.key"}}}, "receivers.tls: "),
    ({"journal": {"enabled": False}, "receivers": {"kafka": {"enabled": True, "brokers": ["127.0.0.1:9"], "topic": "t",
                                                              "group_id": "g"}}},
     "receivers.kafka.enabled: the kafka receiver needs confluent-kafka, which is not installed: "
     "pip install 'agenteval-collector[kafka]'"),
    ({"receivers": {"grpc": {"enabled": False}, "http": {"enabled": False}}},
     "receivers: Value error, no receiver is enabled"),
])
def test_validate_refuses_what_serve_refuses_with_the_same_error(cfg, expected, tmp_path):
    """`agenteval collector validate --config FILE`, as `otelcol validate`: serve's error, exit 1."""
    text = yaml.safe_dump(cfg).replace("{tmp}", str(tmp_path))
    merged = yaml.safe_load(text)
    for section, values in _FREE.items():  # never a fixed port: serve must fail on the config, not a port
        for key, sub in values.items():
            merged.setdefault(section, {}).setdefault(key, {}).setdefault("endpoint", sub["endpoint"])
    merged["store"] = {"url": str(tmp_path / "runs.db")}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(merged))
    env = _shadow_confluent_kafka(tmp_path)
    validated = cli("collector", "validate", "--config", str(path), env=env)
    served = cli("collector", "serve", "--config", str(path), env=env)
    assert validated.returncode == served.returncode == 1, (validated.stderr, served.stderr)
    assert _error_lines(validated.stderr) == _error_lines(served.stderr)
    assert expected in validated.stderr and "Traceback" not in validated.stderr + served.stderr
    assert validated.stdout == ""


def test_validate_accepts_a_good_config_and_starts_nothing(tmp_path):
    store, journal = tmp_path / "runs.db", tmp_path / "journal"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"store": {"url": str(store)}, "journal": {"path": str(journal)},
                                    "receivers": {"grpc": {"endpoint": "${env:GRPC_AT:-127.0.0.1:4317}"}}}))
    proc = cli("collector", "validate", "--config", str(path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{path}: valid\n"
    assert not store.exists() and not journal.exists()
    for shipped in ("config/collector.yaml", "config/container.yaml", "config/replica.yaml"):
        proc = cli("collector", "validate", "--config", str(ROOT / shipped), env={"AGENTEVAL_DB_PASSWORD": "x"})
        assert proc.returncode == 0, (shipped, proc.stderr)


def test_serve_prints_its_banner_before_any_log_line(tmp_path):
    """On a terminal (stdout and stderr on one screen) a fresh store's migration lines came first, JSON
    above the readable banner; and the README's banner is the one printed (the journal's path was not)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(_FREE))
    env = ({k: v for k, v in os.environ.items() if k not in ("AGENTEVAL_STORE", "XDG_DATA_HOME")}
           | {"HOME": str(tmp_path)})
    proc = subprocess.Popen([AGENTEVAL, "collector", "serve", "--config", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = [proc.stdout.readline() for _ in range(12)]
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert lines[0] == "agenteval collector listening:\n", lines
    banner = lines[:lines.index("Press Ctrl-C to stop.\n") + 1]
    assert all(line.startswith("{") for line in lines[len(banner):]), lines  # the log lines, after it
    readme = (ROOT / "README.md").read_text()
    shown = re.search(r"`make run` prints where it listens:\n\n```text\n(.*?)```", readme, re.S)[1]
    # the README shows the default ports and the home directory as ~; here port 0 picked them
    normal = [re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", line.replace(str(tmp_path), "~")).rstrip()
              for line in banner]
    assert [re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", line).rstrip() for line in shown.splitlines()] == normal


def test_make_run_says_what_it_installs_before_the_quiet_minute():
    """`make run` on a fresh clone was a minute of silence (pip runs with --quiet)."""
    # --no-print-directory: under `make test` this make is a sub-make, which says where it enters
    dry = subprocess.run(["make", "--no-print-directory", "-n", "-B", "install"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    first = dry.stdout.splitlines()[0]
    assert first.startswith("echo \"installing agenteval") and "the first time only" in first, dry.stdout
    assert "tools/maf-venv" in dry.stdout.splitlines()[1]
