# GPU decision worker: Clef / Clef-flash behind the micro-batcher (`guard worker serve`).
# Build from the repository root:  docker build -f deploy/docker/worker.Dockerfile -t guard-worker .
# Weights are NOT baked in: mount a local release directory at /models/clef-flash (see docs/operations.md).
FROM nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip curl \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/guard
ENV PATH=/opt/guard/bin:$PATH
# CUDA build of torch first (the version the gateway and CI pin), so installing guard does not pull another one.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130
COPY pyproject.toml README.md LICENSE /src/
COPY guard /src/guard
RUN pip install /src
# The Gated DeltaNet layers run in plain PyTorch here (correct, slower on long prompts): their fast kernels,
# flash-linear-attention and causal-conv1d, need a CUDA compiler this runtime image lacks. Build their wheels in a
# `-devel` stage of the same CUDA and torch and install them here for long prompts (docs/clef.md).

RUN useradd --system --create-home --uid 10001 guard
USER 10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s CMD curl -fsS http://127.0.0.1:8000/readyz || exit 1
# Listening on 0.0.0.0 needs bearer keys: set GUARD_WORKER_API_KEYS (comma-separated, 16+ characters each); the
# gateway sends one in GUARD_BACKEND_API_KEY. /healthz, /readyz and /metrics need no key.
# A release Clef's canaries: the attack state must score 0.3 above the benign one, so a broken or random model (a
# zeroed head, the wrong weights) keeps /readyz at 503; without them any answer that depends on the state passes.
# A later --canary-margin (a container's args) overrides the margin.
ENTRYPOINT ["guard", "worker", "serve", "--model", "/models/clef-flash", "--device", "cuda", "--dtype", "bfloat16", \
            "--host", "0.0.0.0", "--port", "8000", "--api-keys-env", "GUARD_WORKER_API_KEYS", \
            "--canary-margin", "0.3", "--canary-directional"]
