# The image the Helm chart (helm/pdserve) runs: the `pdserve` CLI with the default model baked in.
#
#   CPU image (default):
#     docker build -t pdserve:0.1.0 .
#   GPU image: torch's CUDA build:
#     docker build -t pdserve:0.1.0-cuda \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# Both carry a C compiler: the CPU path's kernels (kernels/csrc) are compiled while the image
# is built, and Triton builds its CUDA launcher at run time.
#
# The chart runs it as user 10001 with a read-only root filesystem; /tmp (also HOME) is an
# emptyDir there. tests/helm/test_helm_dockerfile.py keeps the user, the ports and the torch pin
# in step with the chart and pyproject.toml.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PDSERVE_HOME=/models \
    PDSERVE_NATIVE_DIR=/models/native \
    HOME=/tmp

RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first: the largest layer and the one that changes least. Pinned as in pyproject.toml.
RUN pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0

WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY engine_core ./engine_core
COPY kernels ./kernels
COPY kv_transfer ./kv_transfer
COPY service_infra ./service_infra
COPY gateway ./gateway
COPY prefill_service ./prefill_service
COPY decode_service ./decode_service
COPY pdserve ./pdserve
RUN pip install . && rm -rf /src

# The default model (SmolLM2-135M-Instruct GGUF, checked against its SHA-256) under
# $PDSERVE_HOME and the compiled CPU kernels in $PDSERVE_NATIVE_DIR (every ISA's build, loaded
# from there whatever compiler the running container has), readable by any user; the running
# container never writes there.
RUN pdserve model pull && python -m kernels.native && chmod -R a+rX /models

RUN groupadd --gid 10001 pdserve \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
       --shell /usr/sbin/nologin pdserve
USER 10001:10001
WORKDIR /tmp

# gateway gRPC and HTTP (OpenAI API, /metrics, /health), prefill gRPC, decode gRPC (+ KV
# transfer), worker metrics.
EXPOSE 50051 8000 50061 50071 9090

ENTRYPOINT ["pdserve"]
CMD ["--help"]
