"""The elastic attention backend in vLLM's own shape: Backend, Metadata, Builder, Impl. Glue only:
routing lives in ``state``/``routing``, attention math in ``ops``, vLLM differences in ``compat``.

Selected with ``--attention-backend elastic`` (an alias of AttentionBackendEnum.CUSTOM, see
``plugin.py``); configured with ``--additional-config '{"elastic": {...}}'`` (ElasticConfig).

CUDA graphs: UNIFORM_SINGLE_TOKEN_DECODE with the Triton ops. A pure decode step reads only persistent
buffers that build() updates in place (the runner's seq_lens / block table / query_start_loc and our
``row_modes`` [L, B, Hkv]), and its forward has no host sync. Routing runs only in eager forwards: the
runner hooks keep any step that holds a prompt row out of FULL graphs (PIECEWISE graphs run attention
eagerly). The PyTorch ops read lengths on the host: NEVER (attention always eager) when selected.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from elastic_vllm.vllm_plugin import compat, observe, parallel, warmup
from elastic_vllm.vllm_plugin import state as state_mod
from elastic_vllm.vllm_plugin.ops import resolve_ops, torch_attention, triton_attention
from elastic_vllm.vllm_plugin.routing import RouteBatch

SUPPORTED_HEAD_SIZES = [32, 64, 128, 256]
CUDA_BLOCK_SIZE = 128  # get_preferred_block_size: the kernels' fastest cache block on the H200


class ElasticAttentionBackend(compat.AttentionBackend):
    forward_includes_kv_cache_update: bool = False  # do_kv_cache_update runs first: forward reads the cache
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # resolves in every process (the ELASTIC alias exists only where the plugin loaded)

    @staticmethod
    def get_impl_cls() -> type[ElasticAttentionImpl]:
        return ElasticAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[ElasticMetadataBuilder]:
        return ElasticMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [compat.MultipleOf(16)]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """The KV block size vLLM uses when ``--block-size`` is not given (vLLM 0.26+ asks the backend).

        On CUDA 128: a 128-key tile then lies in one block (one block-table read per tile, affine addresses).
        Measured on the H200 in vLLM 0.26 at Omega_MSR 0.75: TTFT 1.94x FLASH_ATTN at 128K vs 1.84x at vLLM's
        default 16, 1.28x vs 1.24x at 32K (benchmarks/results/e2e-vllm-h200-llama.json). The price is a
        coarser prefix-cache granularity; ``--block-size 16`` keeps vLLM's default. Elsewhere (the CPU build):
        vLLM's default."""
        if compat.on_cuda_platform():
            return max(default_block_size, CUDA_BLOCK_SIZE)
        return default_block_size

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return SUPPORTED_HEAD_SIZES

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    # vLLM 0.26: logical (num_blocks, H, block_size, 2*D), physical NHD
    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        return (0, 1, 3, 2, 4) if include_num_layers_dimension else (0, 2, 1, 3)

    # vLLM 0.32 / 0.33: the same NHD physical order as a layout
    @classmethod
    def supported_kv_cache_layouts(cls):
        return compat.nhd_layouts()


@dataclass
class ElasticMetadata:
    """One step's attention metadata, plain data as vLLM's backends keep it (the engine's mutable state stays with
    the impl): vLLM's tensors, the host copies the torch path loops over, and what the step plan decided."""

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor
    num_decodes: int  # leading single-token rows (the builder asks vLLM to put them first)
    num_decode_tokens: int
    route: RouteBatch | None  # rows routed at this step (eager steps only)
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    prefill_query_start_loc: torch.Tensor | None = None  # [B - num_decodes + 1] (Triton path, mixed steps)
    causal: bool = True
    dense: bool = False  # every head of every row is FA: EngineState.dense_attention (vLLM's FlashAttention) runs it
    fa_split: bool = False  # prompt rows' FA heads on EngineState.fa_heads_attention, the other heads on ours


class ElasticMetadataBuilder(compat.AttentionMetadataBuilder[ElasticMetadata]):
    _cudagraph_support = compat.AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        # the PyTorch ops loop over rows on the host (lengths read at run time): never inside a graph
        extra = getattr(vllm_config, "additional_config", None) or {}
        device = torch.device(vllm_config.device_config.device)
        if resolve_ops(extra.get("elastic_ops") if isinstance(extra, dict) else None, device) == "torch":
            return compat.AttentionCGSupport.NEVER
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)
        self.state = state_mod.for_config(vllm_config)
        parallel.check_stage_layers(self.state.topo, layer_names)
        parallel.warn_if_metrics_stay_here(vllm_config)
        sched = vllm_config.scheduler_config
        capture = getattr(vllm_config.compilation_config, "cudagraph_capture_sizes", None) or [0]
        self.state.attach(
            device,
            max_rows=max(sched.max_num_seqs, max(capture)),
            max_slots=sched.max_num_seqs,
            block_size=kv_cache_spec.block_size,
        )
        compat.install_runner_hooks(state_mod.for_runner, use_v2=self.state.use_v2_runner)
        warmup.maybe_warm_up(self.state, kv_cache_spec, vllm_config)

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False) -> ElasticMetadata:
        cm = common_attn_metadata
        plan = self.state.plan_step(cm)
        qsl = plan.query_start_loc
        num_decodes = 0
        while num_decodes < cm.num_reqs and qsl[num_decodes + 1] - qsl[num_decodes] == 1:
            num_decodes += 1
        prefill_qsl = None
        if self.state.ops == "triton" and num_decodes < cm.num_reqs and not plan.dense:
            prefill_qsl = cm.query_start_loc[num_decodes:] - num_decodes  # once per step, not per layer
        return ElasticMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_reqs=cm.num_reqs,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            route=plan.route,
            query_start_loc_host=qsl,
            seq_lens_host=plan.seq_lens,
            prefill_query_start_loc=prefill_qsl,
            dense=plan.dense,
            fa_split=plan.fa_split,
        )


class ElasticAttentionImpl(compat.AttentionImpl[ElasticMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = "decoder",
        kv_sharing_target_layer_name: str | None = None,
        **extra: Any,
    ) -> None:
        unsupported = {
            "ALiBi": alibi_slopes is not None,
            "sliding-window layers": sliding_window is not None,
            "logits soft-capping": bool(logits_soft_cap),
            f"attention type {attn_type}": attn_type != compat.AttentionType.DECODER,
            "KV-cache sharing": kv_sharing_target_layer_name is not None,
            f"KV-cache dtype {kv_cache_dtype}": kv_cache_dtype != "auto",
            "attention sinks": extra.get("sinks") is not None,
            f"head size {head_size}": head_size not in SUPPORTED_HEAD_SIZES,
            f"dtype {torch.get_default_dtype()}": torch.get_default_dtype()
            not in ElasticAttentionBackend.supported_dtypes,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise NotImplementedError(f"the elastic attention backend does not support {', '.join(bad)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        # configuration, model support and router are checked here, before any weight loads
        self.state = state_mod.for_config(compat.get_current_vllm_config())
        self.params = replace(self.state.params, scale=self.scale)
        self.layer_idx: int | None = None

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = compat.split_kv_cache(kv_cache, self.head_size)
        compat.write_kv_cache(key, value, key_cache, value_cache, slot_mapping, self.kv_cache_dtype, layer)

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: ElasticMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("the elastic attention backend does not support fused output quantization")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        md = attn_metadata
        st = self.state
        if self.layer_idx is None:
            self.layer_idx = compat.extract_layer_index(layer.layer_name)
        li = self.layer_idx
        n = md.num_actual_tokens
        key_cache, value_cache = compat.split_kv_cache(kv_cache, self.head_size)
        if md.route is not None:
            st.route(li, key_cache, md.route)
        if md.dense:
            st.dense_attention(
                query[:n], key_cache, value_cache, output[:n], md.query_start_loc, md.seq_lens, md.block_table,
                md.max_query_len, md.max_seq_len, self.scale,
            )  # fmt: skip
            observe.COUNTERS.forward_calls += 1
            return output
        head_modes = st.row_modes[li, : md.num_reqs]
        if st.ops == "torch":
            torch_attention(
                query[:n],
                key_cache,
                value_cache,
                md.block_table,
                md.query_start_loc_host,
                md.seq_lens_host,
                head_modes,
                self.params,
                output[:n],
                xa_sink=lambda row, h, q0, q1, mask: st.on_xa_mask(li, row, h, q0, q1, mask),
            )
        else:
            triton_attention(
                query[:n],
                key_cache,
                value_cache,
                md.block_table,
                md.query_start_loc,
                md.seq_lens,
                head_modes,
                self.params,
                output[:n],
                md.num_decodes,
                md.num_decode_tokens,
                md.max_query_len,
                md.max_seq_len,
                st.cfg.uses_xattn,
                md.prefill_query_start_loc,
                st.fa_heads_attention if md.fa_split else None,
            )
        observe.COUNTERS.forward_calls += 1
        return output
