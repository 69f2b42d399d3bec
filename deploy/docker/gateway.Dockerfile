# syntax=docker/dockerfile:1
# The gateway image: Python 3.11, the asyncinfer distribution's base dependencies only (no ML runtime).
# Build from the repository root:
#   docker build -f deploy/docker/gateway.Dockerfile -t asyncinfer/gateway:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY asyncinfer ./asyncinfer
COPY services ./services
RUN /opt/venv/bin/pip install ".[server]"

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /opt/asyncinfer/healthcheck.py
# Kubernetes and compose mount the configuration file here (CMD reads it).
RUN groupadd --system --gid 10001 asyncinfer \
    && useradd --system --uid 10001 --gid asyncinfer --home-dir /tmp --shell /usr/sbin/nologin asyncinfer \
    && mkdir -p /etc/asyncinfer
USER 10001:10001
EXPOSE 50051 9101
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "/opt/asyncinfer/healthcheck.py", "127.0.0.1:50051"]
ENTRYPOINT ["asyncinfer"]
CMD ["gateway", "--config", "/etc/asyncinfer/asyncinfer.toml"]
