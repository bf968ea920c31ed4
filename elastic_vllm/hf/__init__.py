"""transformers integration: ``attn_implementation="elastic"`` + router attachment.

The reference engine of the project (vLLM results are compared with it) and the model the router
is trained on. See ``integration.py`` for the API and ``attention.py`` for what runs per layer.
"""

from elastic_vllm.hf.attention import ATTN_IMPLEMENTATION, elastic_attention_forward
from elastic_vllm.hf.integration import (
    attention_modules,
    disable_elastic,
    enable_elastic,
    load_elastic_model,
    register,
)
from elastic_vllm.hf.state import ElasticState, TrainContext

__all__ = [
    "ATTN_IMPLEMENTATION",
    "ElasticState",
    "TrainContext",
    "attention_modules",
    "disable_elastic",
    "elastic_attention_forward",
    "enable_elastic",
    "load_elastic_model",
    "register",
]
