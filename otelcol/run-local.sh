#!/usr/bin/env bash
# The scaled-out topology on this machine, without docker (`make scaleout`; docs/design.md §7): a throwaway
# PostgreSQL (initdb in a temporary directory), two agenteval replicas sharing it, each under its own
# host name with its own journal, and our OpenTelemetry Collector distribution on config/otelcol.yaml
# in front, all on 127.0.0.1 with the compose ports:
#   OTLP in:   127.0.0.1:4317 (gRPC), http://127.0.0.1:4318/v1/traces
#   run pages: http://127.0.0.1:14318/runs and http://127.0.0.1:24318/runs (one shared history)
#   watch:     .venv/bin/agenteval watch --endpoint 127.0.0.1:14317
# Spans also go to Jaeger when OTELCOL_JAEGER_ENDPOINT names one (e.g. 127.0.0.1:4317 of another
# host's Jaeger); without it that pipeline ends in the nop exporter. Ctrl-C stops everything and
# removes the temporary directory. Ports: AGENTEVAL_PG_PORT (25432), OTELCOL_GRPC_ENDPOINT, ...
set -euo pipefail
cd "$(dirname "$0")/.."
otelcol="$(otelcol/build.sh)"
pgbin="${AGENTEVAL_PG_BIN:-}"
if [ -z "$pgbin" ]; then
  initdb="$(ls /usr/lib/postgresql/*/bin/initdb 2>/dev/null | sort -V | tail -1 || true)"
  [ -n "$initdb" ] || initdb="$(command -v initdb || true)"
  [ -n "$initdb" ] || { echo "PostgreSQL not installed: apt-get install postgresql (or set AGENTEVAL_PG_BIN)" >&2; exit 1; }
  pgbin="$(dirname "$initdb")"
fi
pgport="${AGENTEVAL_PG_PORT:-25432}"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/agenteval-scaleout.XXXXXX")"
as=()
if [ "$(id -u)" = 0 ]; then as=(runuser -u postgres --); chown postgres "$tmp"; fi  # initdb refuses root

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  "${as[@]}" "$pgbin/pg_ctl" -D "$tmp/pg" -m fast -w stop >/dev/null 2>&1 || true
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

"${as[@]}" "$pgbin/initdb" -D "$tmp/pg" -U postgres -A trust --no-sync -E UTF8 >/dev/null
"${as[@]}" "$pgbin/pg_ctl" -D "$tmp/pg" -l "$tmp/pg.log" -w -o \
  "-c listen_addresses=127.0.0.1 -p $pgport -c unix_socket_directories=$tmp" start >/dev/null
echo "PostgreSQL on 127.0.0.1:$pgport (log $tmp/pg.log)"

replicas=()
for n in 1 2; do
  mkdir -p "$tmp/agenteval-$n"
  cat >"$tmp/agenteval-$n/collector.yaml" <<YAML
receivers:
  grpc: {endpoint: "127.0.0.1:${n}4317"}
  http: {endpoint: "127.0.0.1:${n}4318"}
store: {url: "postgresql://postgres@127.0.0.1:$pgport/postgres"}
journal: {path: "$tmp/agenteval-$n/journal"}
exporters: {prometheus: {endpoint: "127.0.0.1:${n}9464"}}
YAML
  AGENTEVAL_INSTANCE="agenteval-$n" .venv/bin/agenteval collector serve --config "$tmp/agenteval-$n/collector.yaml" \
    >/dev/null 2>"$tmp/agenteval-$n/collector.log" &
  pids+=($!)
  replicas+=("127.0.0.1:${n}4317")
  echo "agenteval-$n on 127.0.0.1:${n}4317 / http://127.0.0.1:${n}4318/runs (log $tmp/agenteval-$n/collector.log)"
done

for n in 1 2; do
  until grep -q '"collector_listening"' "$tmp/agenteval-$n/collector.log"; do
    if ! kill -0 "${pids[n - 1]}" 2>/dev/null; then
      echo "agenteval-$n did not start:" >&2 && tail -n 20 "$tmp/agenteval-$n/collector.log" >&2 && exit 1
    fi
    sleep 0.1
  done
done

jaeger=()
if [ -z "${OTELCOL_JAEGER_ENDPOINT:-}" ]; then
  jaeger=(--config "yaml:exporters::nop: {}" --config "yaml:service::pipelines::traces/jaeger::exporters: [nop]")
fi
echo "otelcol on ${OTELCOL_GRPC_ENDPOINT:-127.0.0.1:4317} (log $tmp/otelcol.log); Ctrl-C stops all"
AGENTEVAL_REPLICAS="[${replicas[0]}, ${replicas[1]}]" \
OTELCOL_GRPC_ENDPOINT="${OTELCOL_GRPC_ENDPOINT:-127.0.0.1:4317}" \
OTELCOL_HTTP_ENDPOINT="${OTELCOL_HTTP_ENDPOINT:-127.0.0.1:4318}" \
OTELCOL_METRICS_HOST=127.0.0.1 \
  "$otelcol" --config config/otelcol.yaml "${jaeger[@]}" 2>"$tmp/otelcol.log" &
pids+=($!)
status=0
wait "$!" || status=$?  # Ctrl-C: otelcol shuts down cleanly (0) and the trap stops the rest
if [ "$status" != 0 ]; then echo "otelcol exited ($status):" >&2 && tail -n 20 "$tmp/otelcol.log" >&2 && exit 1; fi
