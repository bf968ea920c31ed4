"""The anchors the prefill kernel is timed against, on ``KernelRun.prefill_inputs`` (one prompt, [1, H, S, d]):

    sdpa    torch SDPA flash backend, dense causal (GQA through enable_gqa)
    flex    FlexAttention, ONE compiled call, per-head BlockMask (exact full/partial blocks) = the hybrid anchor
    split   SDPA flash on the FA heads + compiled Flex on the SA heads, two calls (heads pre-split, untimed)
    fa3     vLLM's FlashAttention-3, dense causal, over the same paged cache as ours

``Anchors`` holds one run's compiled FlexAttention calls and BlockMasks (per length, heads and mask).
"""

from __future__ import annotations

import torch
from _kernel_bench import HKV, HQ, KernelRun, sa_heads


class Anchors:
    """The anchors of one run: compiled FlexAttention per kind and BlockMasks per (length, heads, mask)."""

    def __init__(self, run: KernelRun):
        self.run = run
        self._block_masks: dict = {}
        self._flex: dict = {}
        self._sa_flags: torch.Tensor | None = None
        self._hybrid = None

    # --- SDPA ---------------------------------------------------------------------------------------------------
    def sdpa(self, x: dict):
        """(dense causal SDPA call, how it ran): flash with enable_gqa, else K/V expanded outside the timed call."""
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qT, kT, vT = x["qT"], x["kT"], x["vT"]
        backends = [SDPBackend.FLASH_ATTENTION] if self.run.cuda else [SDPBackend.MATH]

        def gqa():
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(qT, kT, vT, is_causal=True, enable_gqa=True)

        try:
            gqa()
            return gqa, "flash+enable_gqa"
        except RuntimeError:  # flash without GQA support
            kE, vE = kT.repeat_interleave(HQ // HKV, 1), vT.repeat_interleave(HQ // HKV, 1)

            def expanded():
                with sdpa_kernel(backends):
                    return F.scaled_dot_product_attention(qT, kE, vE, is_causal=True)

            return expanded, "flash, K/V expanded"

    # --- FlexAttention ------------------------------------------------------------------------------------------
    def hybrid_mask_mod(self, is_sa_q: list[int]):
        """One hybrid mask_mod per run, reading per-query-head SA flags from a tensor updated in place: the
        compiled hybrid call then compiles once per length and head_dim, not once per share."""
        t = torch.tensor(is_sa_q, device=self.run.dev, dtype=torch.bool)
        if self._sa_flags is None or self._sa_flags.shape != t.shape:
            self._sa_flags = t
            sink, window, flags = self.run.sink, self.run.window, t

            def hybrid(b, h, q_idx, kv_idx):
                ssa = (kv_idx < sink) | (q_idx - kv_idx < window)
                return (q_idx >= kv_idx) & (ssa | ~flags[h])

            self._hybrid = hybrid
        else:
            self._sa_flags.copy_(t)
        return self._hybrid

    def ssa_mask_mod(self):
        sink, window = self.run.sink, self.run.window

        def ssa(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & ((kv_idx < sink) | (q_idx - kv_idx < window))

        return ssa

    def block_mask(self, S: int, is_sa_q: list[int], mask_mod, kind: str):
        """BlockMask with exact full/partial blocks (what create_block_mask would build), built block-wise."""
        from torch.nn.attention.flex_attention import BlockMask, create_block_mask

        key = (S, tuple(is_sa_q), kind)
        if key in self._block_masks:
            return self._block_masks[key]
        dev, sink, window = self.run.dev, self.run.sink, self.run.window
        blk = 128
        nb = S // blk
        if S % blk:
            bm = create_block_mask(mask_mod, 1, len(is_sa_q), S, S, device=dev)
            self._block_masks[key] = bm
            return bm
        a = torch.arange(nb, device=dev)
        a0, a1 = (a * blk)[:, None], (a * blk + blk - 1)[:, None]
        c0, c1 = (a * blk)[None, :], (a * blk + blk - 1)[None, :]
        fa_full, fa_part = c1 <= a0, (c0 <= a1) & (c1 > a0)
        any_vis = (c0 <= a1) & ((c0 < sink) | ((a0 - c1).clamp(min=0) < window))
        all_vis = (c1 <= a0) & ((c1 < sink) | (a1 - torch.clamp(c0, min=sink) < window))
        ssa_full, ssa_part = all_vis, any_vis & ~all_vis

        def lists(m):  # [H, nb, nb] bool -> counts [1, H, nb], indices [1, H, nb, nb] (selected first)
            return m.sum(-1).to(torch.int32)[None], torch.argsort(
                m.to(torch.int8), dim=-1, descending=True, stable=True
            ).to(torch.int32)[None]

        sel = torch.tensor(is_sa_q, device=dev, dtype=torch.bool)[:, None, None]
        kn, ki = lists(torch.where(sel, ssa_part[None], fa_part[None]))
        fn, fi = lists(torch.where(sel, ssa_full[None], fa_full[None]))
        try:
            bm = BlockMask.from_kv_blocks(kn, ki, fn, fi, BLOCK_SIZE=blk, mask_mod=mask_mod, compute_q_blocks=False)
        except TypeError:  # torch without compute_q_blocks
            bm = BlockMask.from_kv_blocks(kn, ki, fn, fi, BLOCK_SIZE=blk, mask_mod=mask_mod)
        self._block_masks[key] = bm
        return bm

    def flex(self, kind: str):
        """torch.compile'd flex_attention (never the eager path: it materialises S x S scores). The hybrid call is
        static (one compile per length and head_dim); the split's SA-only call is dynamic."""
        from torch.nn.attention.flex_attention import flex_attention

        if not self.run.cuda:
            return flex_attention
        if kind not in self._flex:
            import torch._dynamo

            cfg = torch._dynamo.config
            cfg.cache_size_limit = max(cfg.cache_size_limit, 64)
            if hasattr(cfg, "accumulated_cache_size_limit"):
                cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 512)
            if hasattr(cfg, "fail_on_cache_limit_hit"):
                cfg.fail_on_cache_limit_hit = True  # an error, not a silent eager fallback that OOMs
            self._flex[kind] = torch.compile(flex_attention, dynamic=(kind == "split"))
        return self._flex[kind]

    def flex_hybrid(self, x: dict, share: float):
        is_sa_q = [s for s in sa_heads(share) for _ in range(HQ // HKV)]
        bm = self.block_mask(x["qT"].shape[2], is_sa_q, self.hybrid_mask_mod(is_sa_q), "hybrid")
        flex = self.flex("hybrid")
        return lambda: flex(x["qT"], x["kT"], x["vT"], block_mask=bm, enable_gqa=True)

    def split(self, x: dict, share: float, sdpa_full):
        """FA heads through SDPA flash, SA heads through Flex: two calls on pre-split head groups."""
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        dev = self.run.dev
        sa = sa_heads(share)
        g = HQ // HKV
        fa_kv = [h for h in range(HKV) if not sa[h]]
        sa_kv = [h for h in range(HKV) if sa[h]]
        calls = []
        if fa_kv and sa_kv:
            qi = torch.tensor([h * g + j for h in fa_kv for j in range(g)], device=dev)
            q1, k1, v1 = (x["qT"][:, qi].contiguous(), x["kT"][:, fa_kv].contiguous(), x["vT"][:, fa_kv].contiguous())
            be = [SDPBackend.FLASH_ATTENTION] if self.run.cuda else [SDPBackend.MATH]

            def fa_call():
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(q1, k1, v1, is_causal=True, enable_gqa=True)

            calls.append(fa_call)
        elif fa_kv:
            calls.append(sdpa_full)
        if sa_kv:
            qi = torch.tensor([h * g + j for h in sa_kv for j in range(g)], device=dev)
            q2, k2, v2 = (x["qT"][:, qi].contiguous(), x["kT"][:, sa_kv].contiguous(), x["vT"][:, sa_kv].contiguous())
            bm = self.block_mask(q2.shape[2], [1] * q2.shape[1], self.ssa_mask_mod(), "ssa")
            flex = self.flex("split")
            calls.append(lambda: flex(q2, k2, v2, block_mask=bm, enable_gqa=True))
        return lambda: [c() for c in calls]

    # --- vLLM's FlashAttention-3 ----------------------------------------------------------------------------------
    def fa3(self, x: dict, bs: int):
        """vLLM's own FlashAttention-3 (``vllm.vllm_flash_attn``, what its FLASH_ATTN backend runs on Hopper), dense
        causal over the same paged cache as ours at ``bs``. Needs the staged vLLM; raises RuntimeError with the
        reason when it is not there."""
        if not self.run.cuda:
            raise RuntimeError("FA3 needs a CUDA GPU")
        try:
            from vllm.vllm_flash_attn import fa_version_unsupported_reason, flash_attn_varlen_func
        except Exception as e:  # ImportError, or vLLM's own import-time errors
            raise RuntimeError(f"vllm.vllm_flash_attn not importable: {e!r}"[:300]) from e
        why = fa_version_unsupported_reason(3)
        if why:
            raise RuntimeError(f"FA3 unsupported here: {why}")
        kc, vc, bt = self.run.paged(x, bs)
        S = x["q"].shape[0]
        out = torch.empty_like(x["q"])
        return lambda: flash_attn_varlen_func(
            x["q"], kc, vc, max_seqlen_q=S, cu_seqlens_q=x["qsl"], max_seqlen_k=S, seqused_k=x["sl"],
            softmax_scale=x["q"].shape[-1] ** -0.5, causal=True, block_table=bt, out=out, fa_version=3,
        )  # fmt: skip
