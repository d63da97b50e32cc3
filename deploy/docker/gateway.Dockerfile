# Slim gateway image: `guard proxy` in front of any HTTP API, deciding with the embedded CPU model (the default
# command) or with one System One backend (`--backend http:...`, the GPU worker: then every question goes to it).
# Build from the repository root:  docker build -f deploy/docker/gateway.Dockerfile -t guard-gateway .
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
RUN python -m venv /opt/guard
ENV PATH=/opt/guard/bin:$PATH
# CPU build of torch (the compact model runs on CPU); an unpinned torch would pull a multi-GB CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md LICENSE /src/
COPY guard /src/guard
COPY policies /etc/guard/policies
# Optional extras, e.g. GUARD_EXTRAS="[examples]" for the example API (FastAPI) that deploy/compose runs from this image.
ARG GUARD_EXTRAS=""
RUN pip install "/src${GUARD_EXTRAS}"

# a home directory for the compact model's ONNX graph cache (~/.cache/guard/compact/onnx; without one each start
# exports the graph again into a temporary directory)
RUN useradd --system --create-home --uid 10001 guard
USER 10001
EXPOSE 8080
ENTRYPOINT ["guard", "proxy"]
# The default command runs on the embedded CPU model alone: a policy of catalog questions (api_abuse.yaml also asks a
# free-form question, so it needs --backend pointing at a Clef worker, as deploy/compose passes it). The policy
# escalates uncertain requests, and without --review-tokens-env no reviewer can answer them: guard proxy logs a
# warning naming the policy. Pass your own command with --review-tokens-env VAR for anything but a trial.
CMD ["--policy", "/etc/guard/policies/api_abuse_compact.yaml", "--upstream", "http://api:8000", "--listen", "0.0.0.0:8080", \
     "--admin-listen", "0.0.0.0:9901"]
