"""Entry point of the ``vllm.general_plugins`` group (setup.py): ``elastic = elastic_vllm.vllm_plugin.plugin:register``.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), before
it parses ``--attention-backend`` in the API server. It is idempotent, cheap (no backend module,
no CUDA, no allocation), and spawn-safe:

- the backend class goes into the static ``AttentionBackendEnum.CUSTOM`` slot, and ``ELASTIC`` is an
  alias of CUSTOM in the enum's member map: ``--attention-backend elastic`` resolves to CUSTOM and a
  pickled VllmConfig carries CUSTOM, which every process can unpickle before plugins load (a new enum
  member cannot be);
- on the CPU platform, a CUSTOM selection (ours) returns our class instead of CPU_ATTN;
- when a VllmConfig selecting elastic is built (API server, offline LLM), before any engine starts:
  configuration, model, router checkpoint and metrics folder are checked (``precheck.py``);
- at request admission, when the engine serves elastic: ``vllm_xargs`` is validated against the server's
  ``client_overrides``, and the request's cache salt gets its routing mode (``overrides.py``);
- in the engine core, when ``load_policy`` is on: the scheduler's backlog sets the bias of new requests
  (``load_policy.py``).

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
    from elastic_vllm.vllm_plugin import compat, load_policy

    _share_vllm_logging()
    if compat.register_custom_backend(BACKEND_PATH, ALIAS):
        compat.route_cpu_platform_custom_backend(BACKEND_PATH)
        compat.install_request_validator(_validate, _cache_salt, BACKEND_PATH)
        compat.install_startup_check(_startup_check, BACKEND_PATH)
        load_policy.install(BACKEND_PATH)
    _registered = True


class _ToVllmHandlers(logging.Handler):
    """Hands each record to the handlers of vLLM's "vllm" logger as they are when it is emitted (vLLM configures
    them after plugins load in some processes), so the plugin's lines carry vLLM's format, stream and level."""

    def emit(self, record: logging.LogRecord) -> None:
        for h in logging.getLogger("vllm").handlers:
            if record.levelno >= h.level:
                h.handle(record)


def _share_vllm_logging() -> None:
    """vLLM configures only its own "vllm" logger, so without this the plugin's INFO lines (the router taken, the
    kernel warm-up and what runs all-FA steps) never reached a server's log. Records still propagate to the root
    logger's handlers (pytest's, an application's)."""
    ours = logging.getLogger("elastic_vllm")
    if any(isinstance(h, _ToVllmHandlers) for h in ours.handlers):
        return
    ours.addHandler(_ToVllmHandlers())
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)


def _startup_check(vllm_config, http: bool) -> None:
    from elastic_vllm.vllm_plugin.precheck import check_engine_config

    check_engine_config(vllm_config, http)


def _validate(params, vllm_config) -> None:
    from elastic_vllm.vllm_plugin.overrides import server_config, validate_sampling_params

    server = server_config(vllm_config)
    validate_sampling_params(params, server[0] if server else None)


def _cache_salt(params, vllm_config, client_salt: str | None) -> str | None:
    from elastic_vllm.vllm_plugin.overrides import routing_cache_salt, salted, server_config

    server = server_config(vllm_config)
    if server is None:  # an invalid configuration: the engine refuses to start
        return client_salt
    return salted(client_salt, routing_cache_salt(getattr(params, "extra_args", None), *server))
