"""vLLM integration: ``vllm serve MODEL --attention-backend elastic``.

Modules: ``plugin`` (entry point, registration), ``backend`` (vLLM's four classes: Backend, Builder,
Metadata, Impl — glue only), ``state`` (per-engine routing state and per-request lifecycle),
``routing`` (boundary keys -> pre-RoPE -> router), ``ops`` (attention: PyTorch or Triton),
``observe`` (the once-per-request routing seam, registry and counters), ``overrides`` (per-request
``elastic_force``), ``compat`` (every vLLM import and version difference).

Importing this package imports nothing from vLLM.
"""
