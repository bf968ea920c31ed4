# elastic-vllm on the official vLLM OpenAI server image (GPU: vLLM 0.26, the version run on the H200).
#   docker build -t elastic-vllm .
#   docker run --gpus all --ipc=host -p 8000:8000 \
#       -v ~/.cache/huggingface:/root/.cache/huggingface -v "$PWD/runs/r1/router:/routers/my-model:ro" \
#       elastic-vllm MODEL --additional-config '{"elastic": {"router_path": "/routers/my-model"}}'
# The entry point is `elastic-vllm serve`: it prepares Prometheus multiprocess mode (the elastic: metrics on
# /metrics) and execs `vllm serve MODEL ... --attention-backend elastic`; arguments after the image name go
# to vLLM. Routers committed in router_weights/ are in the image and found by backbone shape.
# Linted with hadolint by tests/test_docs.py; not built in CI (the development machines have no Docker engine).
FROM vllm/vllm-openai:v0.26.0

WORKDIR /opt/elastic-vllm
COPY setup.py pyproject.toml README.md ./
COPY elastic_vllm ./elastic_vllm
COPY router_weights ./router_weights
RUN python3 -m pip install --no-cache-dir . \
    && python3 -c "import elastic_vllm.ops.prefill, elastic_vllm.vllm_plugin.plugin"

# a non-editable install does not see the checkout: name the shipped routers' folder
ENV ELASTIC_VLLM_CACHE=/root/.cache/elastic-vllm \
    ELASTIC_VLLM_ROUTER_WEIGHTS=/opt/elastic-vllm/router_weights
EXPOSE 8000
ENTRYPOINT ["elastic-vllm", "serve"]
