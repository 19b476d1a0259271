# webhook-dedup-proxy: the proxy, its dependencies, uvloop (extra "fast") and the OpenTelemetry
# SDK with its OTLP/HTTP exporter (extra "otel": off unless OTEL_EXPORTER_OTLP_ENDPOINT or
# OTEL_TRACES_EXPORTER asks for traces), nothing else.
#
# Build: docker build -t dedup-proxy .       (or: buildah bud -t dedup-proxy .)
# Run:   docker run --read-only -e DATABASE_URL=postgresql://user:secret@db:5432/app \
#          -e UPSTREAM_URL=http://app:3000 -p 8080:8080 -p 127.0.0.1:9901:9901 dedup-proxy
#
# - Configuration: deploy/config.yaml is the default at /etc/dedup-proxy/config.yaml; mount your
#   own file there (-v "$PWD/config.yaml:/etc/dedup-proxy/config.yaml:ro", a ConfigMap).
# - No embedded PostgreSQL: DATABASE_URL must name a real server (it is required).
# - Runs as uid/gid 10001 and writes nothing to its filesystem, so the root filesystem can be
#   read-only. Only `workers` > 1 needs a writable /tmp (the workers' shared metrics files):
#   then mount a tmpfs there (--tmpfs /tmp, or an emptyDir with medium: Memory).
# - Port 8080: webhooks. Port 9901: admin (/healthz, /readyz, /metrics), not for the internet.

FROM python:3.11-slim-bookworm AS build
# The compiled build (setup.py, DEDUP_PROXY_COMPILE=1: the hot modules compiled with mypyc, about
# 13 % fewer instructions per webhook) needs a C compiler and Python's headers, here only: the
# runtime stage below gets the built modules, not the tools. (The official image has the headers;
# a stand-in base with Debian's Python gets them from libpython3.11-dev.)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && { test -e "$(python -c 'import sysconfig; print(sysconfig.get_path("include"))')/Python.h" \
         || apt-get install -y --no-install-recommends libpython3.11-dev; } \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proxy ./proxy
# Installed under /install in /usr/local's layout (the dedup-proxy script runs /usr/local/bin's
# python), then copied to /usr/local below: no wheels, sources or pip cache in the runtime stage.
# First everything, then the package again, compiled: mypyc type-checks it against the installed
# dependencies (PYTHONPATH) and the stubs. mypy, setuptools and the stubs are the build's only.
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_WARN_SCRIPT_LOCATION=1
RUN pip install --prefix=/install "/src[fast,otel,github-app]" \
    && pip install "mypy==2.4.1" "setuptools>=77" "asyncpg-stubs==0.32.0" \
        "types-PyYAML==6.0.12.20261122" \
    && DEDUP_PROXY_COMPILE=1 PYTHONPATH=/install/lib/python3.11/site-packages \
        pip install --prefix=/install --no-deps --no-build-isolation --force-reinstall /src

FROM python:3.11-slim-bookworm
# proxy.__version__, the tag the image is pushed under (docs/development.md, "Releases").
LABEL org.opencontainers.image.title="dedup-proxy" \
      org.opencontainers.image.version="0.4.0.dev0"
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN groupadd --system --gid 10001 dedup \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin dedup
COPY --from=build /install /usr/local
COPY --chmod=0644 deploy/config.yaml /etc/dedup-proxy/config.yaml
USER 10001:10001
EXPOSE 8080 9901
# No HEALTHCHECK: probing is the orchestrator's (kubelet: /readyz and /healthz on port 9901).
ENTRYPOINT ["dedup-proxy"]
CMD ["serve", "--config", "/etc/dedup-proxy/config.yaml"]
