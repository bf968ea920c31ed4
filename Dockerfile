# elastic-vllm on the official vLLM OpenAI server image (GPU).
#   docker build -t elastic-vllm .
#   docker run --gpus all -p 8000:8000 elastic-vllm MODEL --additional-config '{"elastic": {"router_path": "/routers/my-model"}}'
# The entry point is `elastic-vllm serve`: it prepares Prometheus multiprocess mode and execs
# `vllm serve ... --attention-backend elastic`.
FROM vllm/vllm-openai:v0.26.0

WORKDIR /opt/elastic-vllm
COPY setup.py pyproject.toml README.md ./
COPY elastic_vllm ./elastic_vllm
COPY csrc ./csrc
COPY router_weights ./router_weights
RUN python3 -m pip install --no-cache-dir . \
    && python3 -c "import elastic_vllm.csrc, elastic_vllm.vllm_plugin.plugin"

ENV ELASTIC_VLLM_CACHE=/root/.cache/elastic-vllm
EXPOSE 8000
ENTRYPOINT ["elastic-vllm", "serve"]
