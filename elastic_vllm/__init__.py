"""elastic-vllm: Elastic Attention (per-request FA/SA routing of KV heads) for vLLM.

Importing this package has no side effects: nothing is compiled, patched or allocated.
The vLLM plugin registers itself through the ``vllm.general_plugins`` entry point.
"""

__version__ = "0.1.0"

from elastic_vllm.config import ConfigError, ElasticConfig, HeadMode

__all__ = ["ConfigError", "ElasticConfig", "HeadMode", "__version__"]
