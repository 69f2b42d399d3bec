# syntax=docker/dockerfile:1
# The batcher image: a CUDA runtime base, Python 3.11, torch (CUDA build) and asyncinfer[batcher].
# Build from the repository root:
#   docker build -f deploy/docker/batcher.Dockerfile -t asyncinfer/batcher:0.1.0 .
# pyproject pins torch==2.13.0; on the developers' machines that resolves to a CPU wheel on local
# disk. Here torch comes first from the PyTorch index named by TORCH_INDEX_URL (a CUDA build of
# the same version; its wheels carry their CUDA libraries, so the host needs only the NVIDIA
# driver), and `pip install .[batcher]` then finds the pin satisfied. Pick the index whose CUDA
# version your driver supports (cu126, cu128, ...); for a CPU-only image pass
# --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu22.04

FROM ${CUDA_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Ubuntu 22.04 ships Python 3.10; 3.11 comes from the deadsnakes PPA.
RUN apt-get update \
    && apt-get install -y --no-install-recommends software-properties-common gpg-agent \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/venv
RUN /opt/venv/bin/pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY asyncinfer ./asyncinfer
COPY services ./services
RUN /opt/venv/bin/pip install ".[batcher]" \
    && /opt/venv/bin/python -c "import torch; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__"

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends software-properties-common gpg-agent \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 \
    && apt-get purge -y software-properties-common gpg-agent \
    && apt-get autoremove -y \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    HF_HUB_OFFLINE=1
COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /opt/asyncinfer/healthcheck.py
RUN groupadd --system --gid 10001 asyncinfer \
    && useradd --system --uid 10001 --gid asyncinfer --home-dir /tmp --shell /usr/sbin/nologin asyncinfer \
    && mkdir -p /etc/asyncinfer
USER 10001:10001
EXPOSE 50053 9103
# Loading models (minilm-l6 on a GPU) takes longer than the other services' start.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "/opt/asyncinfer/healthcheck.py", "127.0.0.1:50053"]
ENTRYPOINT ["asyncinfer"]
CMD ["batcher", "--config", "/etc/asyncinfer/batcher.toml"]
