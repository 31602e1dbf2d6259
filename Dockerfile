# One agenteval collector replica (docker-compose.yml runs two behind the OpenTelemetry Collector).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY collector ./collector
RUN pip install --no-cache-dir '.[postgres]' && useradd --system agenteval
USER agenteval
# OTLP/gRPC + FidelityService, OTLP/HTTP + run page, Prometheus /metrics
EXPOSE 4317 4318 9464
ENTRYPOINT ["agenteval", "collector", "serve"]
CMD ["--config", "/etc/agenteval/collector.yaml"]
