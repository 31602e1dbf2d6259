# One agenteval collector replica (docker-compose.yml runs two behind the OpenTelemetry Collector).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY collector ./collector
# Not built here (no Rust in this image): the compiled decoder, native/. The image decodes protobuf in
# Python, which costs several times more CPU per span (native/README.md).
RUN pip install --no-cache-dir '.[postgres]' && useradd --system agenteval
USER agenteval
# OTLP/gRPC + FidelityService, OTLP/HTTP + run page, Prometheus /metrics
EXPOSE 4317 4318 9464
ENTRYPOINT ["agenteval", "collector", "serve"]
CMD ["--config", "/etc/agenteval/collector.yaml"]
