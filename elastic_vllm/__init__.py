"""elastic-vllm: Elastic Attention (per-request FA/SA routing of KV heads) for vLLM.

Importing this package has no side effects: nothing is compiled, patched or allocated, and nothing is imported
until a name is used (the kernels' checks on a bare GPU image import ``elastic_vllm.provenance`` without the
configuration's pydantic). The vLLM plugin registers itself through the ``vllm.general_plugins`` entry point.
"""

__version__ = "0.1.0"

__all__ = ["ConfigError", "ElasticConfig", "HeadMode", "__version__"]


def __getattr__(name: str):
    """The configuration classes on first use (PEP 562): ``elastic-vllm`` commands that refuse their input at once
    (a missing model folder) must not wait for pydantic (0.6 s of the 2-core machine's ~1.2 s)."""
    if name in ("ConfigError", "ElasticConfig", "HeadMode"):
        from elastic_vllm import config

        return getattr(config, name)
    raise AttributeError(f"module 'elastic_vllm' has no attribute {name!r}")
