# One agenteval collector replica (docker-compose.yml runs two behind the OpenTelemetry Collector; the
# Helm chart in deploy/helm/agenteval runs it on Kubernetes). It is the build bench/ measured: the
# collector with the compiled decoder (native/), logged at start as "decoder":"native".
# It runs as a non-root user (numeric, so Kubernetes' runAsNonRoot can check it) whose only writable
# place is DATA_DIR, the VOLUME below: the run store and the crash journal (config/container.yaml).
# tests/test_deploy.py installs the same two wheels into a fresh environment and starts them the way
# this image does (its user, config, data directory and environment, read from this file).
#
#   docker build -t agenteval-collector .
#   docker run -p 4317:4317 -p 4318:4318 -p 9464:9464 -v agenteval-data:/var/lib/agenteval agenteval-collector

ARG PYTHON_VERSION=3.11
# The Rust toolchain comes from the official image (the same Debian release as the Python one).
FROM rust:1.95-slim-trixie AS rust

FROM python:${PYTHON_VERSION}-slim-trixie AS build
COPY --from=rust /usr/local/cargo /usr/local/cargo
COPY --from=rust /usr/local/rustup /usr/local/rustup
ENV CARGO_HOME=/usr/local/cargo RUSTUP_HOME=/usr/local/rustup PATH=/usr/local/cargo/bin:$PATH
# The linker rustc calls (the build stage only: its versions do not reach the image).
# hadolint ignore=DL3008
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The compiled decoder's wheel, by the script `make install` uses (maturin, from PyPI).
COPY native ./native
RUN mkdir /wheels && cp "$(XDG_CACHE_HOME=/cache native/build.sh python)" /wheels/
COPY pyproject.toml README.md ./
COPY collector ./collector
RUN pip wheel --quiet --no-deps --wheel-dir /wheels .

FROM python:${PYTHON_VERSION}-slim-trixie
ARG DATA_DIR=/var/lib/agenteval
ARG UID=10001
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir /wheels/agenteval_native-*.whl "$(echo /wheels/agenteval_collector-*.whl)[postgres]" \
    && groupadd --system --gid ${UID} agenteval \
    && useradd --system --uid ${UID} --gid ${UID} --home-dir ${DATA_DIR} --create-home --shell /usr/sbin/nologin agenteval
COPY config/container.yaml /etc/agenteval/collector.yaml
# HOME too is the data directory: anything that defaults under it stays writable.
ENV HOME=${DATA_DIR}
VOLUME ${DATA_DIR}
USER ${UID}:${UID}
WORKDIR ${DATA_DIR}
# OTLP/gRPC + FidelityService, OTLP/HTTP + run page, Prometheus /metrics
EXPOSE 4317 4318 9464
# Healthy once the gRPC port accepts connections: it opens after the journal has been replayed.
# Healthy = ready: the journal replayed (the HTTP port opens after it) and the run store reachable.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:4318/readyz', timeout=3)"]
ENTRYPOINT ["agenteval", "collector", "serve"]
CMD ["--config", "/etc/agenteval/collector.yaml"]
