# Build: docker build -t dedup-proxy .
# Run:   docker run -v $PWD/config.yaml:/etc/dedup-proxy/config.yaml:ro \
#          -e DATABASE_URL=postgresql://... -p 8080:8080 dedup-proxy
# No embedded database in the image: point database.dsn at your PostgreSQL.

FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proxy ./proxy
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[fast]"

FROM python:3.11-slim-bookworm
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin dedup
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index /wheels/*.whl \
    && rm -rf /wheels
USER 10001
EXPOSE 8080
ENTRYPOINT ["dedup-proxy"]
CMD ["serve", "--config", "/etc/dedup-proxy/config.yaml"]
