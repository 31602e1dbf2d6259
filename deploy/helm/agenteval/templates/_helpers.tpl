{{- define "agenteval.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-<chart>, or fullnameOverride; short enough for a "-otelcol" suffix and pod names. */}}
{{- define "agenteval.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "agenteval.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "agenteval.otelcol" -}}
{{- printf "%s-otelcol" (include "agenteval.fullname" .) -}}
{{- end -}}

{{- define "agenteval.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "agenteval.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component (collector or otelcol): pass (list . "collector"). */}}
{{- define "agenteval.selector" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "agenteval.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* The run store's URL: store.url (a PostgreSQL), else SQLite on the volume (one replica). */}}
{{- define "agenteval.storeUrl" -}}
{{- if .Values.store.url -}}
{{- if not (hasPrefix "postgresql://" .Values.store.url) -}}
{{- fail "store.url: expected postgresql://user@host:5432/database (without store.url, one replica keeps SQLite on its volume)" -}}
{{- end -}}
{{- if regexMatch "^postgresql://[^/@]*:[^/@]*@" .Values.store.url -}}
{{- fail "store.url: has a password: put it in store.password or a Secret (store.existingSecret) instead" -}}
{{- end -}}
{{- .Values.store.url -}}
{{- else -}}
{{- if gt (int .Values.replicas) 1 -}}
{{- fail "replicas > 1 need one shared PostgreSQL store: set store.url (postgresql://user@host:5432/database)" -}}
{{- end -}}
{{- printf "%s/runs.db" .Values.dataDir -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the PostgreSQL password as a dict {name, key}, or an empty dict. */}}
{{- define "agenteval.passwordSecret" -}}
{{- if and .Values.store.password .Values.store.existingSecret -}}
{{- fail "set store.password or store.existingSecret, not both" -}}
{{- end -}}
{{- range $key := list "password" "existingSecret" -}}
{{- if and (get $.Values.store $key) (not $.Values.store.url) -}}
{{- fail (printf "store.%s: needs store.url, the PostgreSQL it is the password of (without store.url, one replica keeps SQLite on its volume)" $key) -}}
{{- end -}}
{{- end -}}
{{- if .Values.store.existingSecret -}}
{{- dict "name" .Values.store.existingSecret "key" .Values.store.existingSecretKey | toJson -}}
{{- else if .Values.store.password -}}
{{- dict "name" (printf "%s-store" (include "agenteval.fullname" .)) "key" "password" | toJson -}}
{{- else -}}
{{- dict | toJson -}}
{{- end -}}
{{- end -}}

{{/* The collector's config file: collectorConfig under the keys the chart sets. */}}
{{- define "agenteval.collectorConfig" -}}
{{- $store := dict "url" (include "agenteval.storeUrl" .) -}}
{{- if include "agenteval.passwordSecret" . | fromJson -}}
{{- $_ := set $store "password_env" "AGENTEVAL_DB_PASSWORD" -}}
{{- end -}}
{{- $receivers := dict "grpc" (dict "endpoint" (printf "0.0.0.0:%d" (int .Values.ports.grpc)))
                      "http" (dict "endpoint" (printf "0.0.0.0:%d" (int .Values.ports.http))) -}}
{{- $journal := dict "path" (printf "%s/journal" .Values.dataDir) -}}
{{- if .Values.kafka.enabled -}}
{{- $_ := set $receivers "kafka" (dict "enabled" true "brokers" (include "agenteval.kafkaBrokers" . | fromJsonArray)
      "topic" .Values.kafka.topic "group_id" (.Values.kafka.groupId | default (include "agenteval.fullname" .))
      "client" .Values.kafka.consumer) -}}
{{- $_ := set $journal "enabled" false -}}
{{- end -}}
{{- $chart := dict
  "receivers" $receivers
  "store" $store
  "journal" $journal
  "exporters" (dict "prometheus" (dict "endpoint" (printf "0.0.0.0:%d" (int .Values.ports.metrics)))) -}}
{{- if not .Values.kafka.enabled -}}
{{- $_ := set $chart "shutdown_delay" (float64 .Values.shutdownDelay) -}}
{{- end -}}
{{- mustMergeOverwrite (deepCopy .Values.collectorConfig) $chart | toYaml -}}
{{- end -}}

{{/* kafka.brokers as a JSON list, refusing an empty one when kafka.enabled. */}}
{{- define "agenteval.kafkaBrokers" -}}
{{- if not .Values.kafka.brokers -}}
{{- fail "kafka.brokers: give the Kafka bootstrap servers (host:port each) with kafka.enabled" -}}
{{- end -}}
{{- .Values.kafka.brokers | toJson -}}
{{- end -}}
