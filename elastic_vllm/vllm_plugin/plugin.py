"""Entry point of the ``vllm.general_plugins`` group (setup.py): ``elastic = elastic_vllm.vllm_plugin.plugin:register``.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), before
it parses ``--attention-backend`` in the API server. It is idempotent, cheap (no backend module,
no CUDA, no allocation), and spawn-safe:

- the backend class goes into the static ``AttentionBackendEnum.CUSTOM`` slot, and ``ELASTIC`` is an
  alias of CUSTOM in the enum's member map: ``--attention-backend elastic`` resolves to CUSTOM and a
  pickled VllmConfig carries CUSTOM, which every process can unpickle before plugins load (a new enum
  member cannot be);
- on the CPU platform, a CUSTOM selection (ours) returns our class instead of CPU_ATTN;
- at request admission, ``vllm_xargs.elastic_force`` is validated when the engine serves elastic.

With another backend selected nothing of the elastic backend runs.
"""

from __future__ import annotations

import logging

BACKEND_PATH = "elastic_vllm.vllm_plugin.backend.ElasticAttentionBackend"
ALIAS = "ELASTIC"

logger = logging.getLogger("elastic_vllm.vllm_plugin")
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from elastic_vllm.vllm_plugin import compat
    from elastic_vllm.vllm_plugin.overrides import validate_sampling_params

    if compat.register_custom_backend(BACKEND_PATH, ALIAS):
        compat.route_cpu_platform_custom_backend(BACKEND_PATH)
        compat.install_request_validator(validate_sampling_params, BACKEND_PATH)
    _registered = True
