"""No Triton kernel compiles while serving: every launch the engine makes has a specialization that the
warm-up already compiled.

Triton compiles one binary per specialization key of a launch: the constexprs and the launch options, every
int argument's "== 1" / "divisible by 16", every pointer's 16-byte alignment (unless the kernel opts out per
argument). A key the warm-up did not produce compiles inside a request (on the H200 vLLM's JIT monitor reports
it; a prefill kernel compile costs seconds of TTFT). Here a real CPU vLLM engine (ops=triton, Triton's
interpreter) serves mixed steps (decodes next to chunked prefills, so the prefill's tensors are row slices
starting past the decode rows), and the key of each launch is computed by Triton's own binder
(``create_function_from_signature``, the code ``JITFunction.run`` uses) and compared with the keys of
``warmup.warm_up`` on the same engine state. The engine's block table is as wide as max_model_len needs
(its row stride differs from the warm-up's), the case that once compiled the prefill kernel at the first
prompt past sink + window.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from elastic_vllm.ops.decode import kernel as decode
from elastic_vllm.ops.prefill import kernel as prefill
from elastic_vllm.ops.route import kernel as route
from elastic_vllm.ops.xattn_select import kernel as xattn_select
from elastic_vllm.reference.attention import dense_paged_attention
from elastic_vllm.router.model import ElasticRouter
from elastic_vllm.vllm_plugin import backend, compat, observe, warmup
from elastic_vllm.vllm_plugin import state as state_mod

from .conftest import close_llm, make_llm, state_of
from .helpers import event_of, greedy
from .routers import save_test_router
from .tiny_models import TINY, build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _routers import fixed_share_router

pytestmark = pytest.mark.slow

KERNELS = {
    prefill: ["_prefill_kernel"],
    decode: ["_decode_kernel", "_decode_merge_kernel"],
    xattn_select: ["_xattn_select_kernel"],
    route: ["_route_pool_kernel", "_route_task_kernel", "_route_router_kernel"],
}


def _binder(kernel):
    """Triton's argument binder of a kernel (its specialization rule), built from the interpreted wrapper's
    function and decorator arguments, as ``JITFunction`` builds it on a GPU."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jf = JITFunction(kernel.fn, **{k: v for k, v in kernel.kwargs.items() if v is not None})
    return create_function_from_signature(jf.signature, jf.params, BaseBackend)


class _Recorder:
    """Stands in for a kernel: records each launch's specialization key, then launches the real kernel."""

    def __init__(self, name, kernel, log):
        self.name, self.kernel, self.log = name, kernel, log
        self.bind = _binder(kernel)

    def __getitem__(self, grid):
        def launch(*args, **kw):
            _, spec, options = self.bind(*args, **kw)
            self.log[self.name].add(repr((spec, sorted(options.items()))))
            return self.kernel[grid](*args, **kw)

        return launch


def test_binder_sees_alignment_and_divisibility():
    """The key really changes with what Triton specialises on (else the comparison below proves nothing):
    an int's divisibility by 16 and a pointer's 16-byte alignment change it; a do_not_specialize int does not."""
    bind = _binder(prefill._prefill_kernel)
    names = list(bind.__code__.co_varnames[: bind.__code__.co_argcount])
    x = torch.zeros(64, dtype=torch.float32)
    i_scale = names.index("qk_scale")
    base = {n: x for n in names[:11]}  # the tensors: q ... xa_cnt
    base.update({n: 16 for n in names[11:i_scale]})  # strides, counts, sink, window
    base["qk_scale"] = 1.0
    const = dict(G=1, BLOCK_Q=16, BLOCK_M=16, BLOCK_N=16, BS=16, HEAD_DIM=16, BLOCK_D=16, TILE_IN_BLOCK=True,
                 HAS_SLOTS=False, HAS_XA=False, XA_BLOCK=16, DOT_PREC="ieee", BLOCK_H=2, SKIP_FA=False)  # fmt: skip
    assert set(base) | set(const) == set(names)

    def key(**change):
        return repr(bind(**{**base, **const, **change})[1])

    assert key() != key(s_qt=24)  # a specialised stride
    assert key() == key(s_bt=24)  # not specialised
    assert key() != key(q=x[1:])  # a pointer 4 bytes off 16-byte alignment
    assert key() == key(block_table=x[1:])  # opted out of alignment


CASES = {
    "FA-SSA": {"mode": "FA-SSA"},
    "XA-SSA": {"mode": "XA-SSA"},
    # the benchmarks' head-mixing router (an FA and an SA KV head in every layer), hybrid prompt steps with their
    # FA heads on a dense kernel (vLLM's FlashAttention on the GPU; the warm-up admits a stand-in here) and
    # requests with a fixed SA budget (the router kernel's logits-only launch)
    "FA-SSA-mixed-split-budget": {"mode": "FA-SSA", "mixed": True},
}


@pytest.mark.parametrize("case", list(CASES))
def test_serving_launches_only_warmed_up_variants(tmp_path, demo_model_dir, monkeypatch, case):
    assert os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py
    mode, mixed = CASES[case]["mode"], CASES[case].get("mixed", False)
    kind = "llama"
    model = build_tiny_model(kind, tmp_path / kind, demo_model_dir)
    if mixed:
        router = fixed_share_router(model, tmp_path, 0.5, "heads")
        monkeypatch.setattr(state_mod, "FA_SPLIT_MIN_SEQ", 0)  # every hybrid prompt step splits
        monkeypatch.setattr(compat, "flash_attn_dense", lambda dtype, d: (dense_paged_attention, "test stand-in"))
    else:
        torch.manual_seed(1)
        router = save_test_router(
            ElasticRouter(2, TINY[kind]["head_dim"]), tmp_path / "router", TINY[kind]["num_key_value_heads"]
        )
    knobs = {"sink": 2, "window": 8, "mode": mode, "decode_mode": "sparse"}
    if mode == "XA-SSA":
        knobs.update(xattn_block=16, xattn_stride=4, xattn_threshold=0.5)
    log = {"warm-up": defaultdict(set), "serving": defaultdict(set)}
    phase = {"now": "serving"}
    for mod, names in KERNELS.items():
        for n in names:
            rec = _Recorder(n, getattr(mod, n), log["warm-up"])
            monkeypatch.setattr(mod, n, rec)
            phase.setdefault("recs", []).append(rec)
    # the warm-up's own batch is small under the interpreter; the engine's shapes are what matters
    monkeypatch.setattr(warmup, "PROMPT_LENS", (40, 9))
    monkeypatch.setattr(warmup, "DECODE_LEN", 20)
    mixed_steps = []  # (decode rows, rows) of the engine's steps that had prompt rows
    real_attention = backend.triton_attention

    def attention(q, kc, vc, bt, qsl, sl, hm, p, out, num_decodes, *rest):
        if num_decodes < sl.shape[0]:
            mixed_steps.append((num_decodes, sl.shape[0]))
        return real_attention(q, kc, vc, bt, qsl, sl, hm, p, out, num_decodes, *rest)

    monkeypatch.setattr(backend, "triton_attention", attention)
    cfg = {"elastic": {**knobs, "router_path": str(router)}, "elastic_ops": "triton"}
    # block size 32 and max_model_len 1024: a block table of 32 int32 per row (128 bytes: any row slice is
    # 16-byte aligned), against the warm-up's table of a few blocks per row (a slice past one row is not)
    llm = make_llm(
        model,
        attention_backend="elastic",
        additional_config=cfg,
        max_num_batched_tokens=40,
        max_num_seqs=8,
        block_size=32,
        max_model_len=1024,
    )
    try:
        st = state_of(llm)  # this engine's (an earlier case's state may still be alive in this process)
        assert st.cfg.mode == mode and st.cfg.window == 8
        assert st.ops == "triton" and st.kernel_router is not None
        heads = TINY[kind]["num_attention_heads"]
        report = warmup.warm_up(st, torch.float32, heads, TINY[kind]["head_dim"])
        assert (report["fa_split"] is not None) == mixed, report
        for rec in phase["recs"]:
            rec.log = log["serving"]
        words = "the quick brown fox jumps over a lazy dog while rain falls on".split()
        # prompts of 20-60 tokens with budget 40 per step: chunked prefills next to the first ones' decodes
        prompts = [" ".join(words[: 4 + 3 * i] * 3) for i in range(5)]
        budget = {"elastic_target_omega": 0.5} if mixed else None
        params = [greedy(4, ignore_eos=True, xargs=budget if i % 2 else None) for i in range(len(prompts))]
        split0 = observe.COUNTERS.fa_split_steps
        outs = llm.generate(prompts, params, use_tqdm=False)
        split_steps = observe.COUNTERS.fa_split_steps - split0
        events = [event_of(o.request_id) for o in outs]
    finally:
        close_llm(llm)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    if mixed:  # the paths under test ran: split steps, budgets, FA and SA heads in every layer
        assert split_steps > 0
        assert [e.target_omega for e in events] == [None, 0.5, None, 0.5, None]
        for e in events[::2]:
            assert e.head_modes.shape[-1] == 2 and bool((e.head_modes == 0).sum(-1).eq(1).all()), e.head_modes
    served = log["serving"]
    assert any(d > 0 for d, _ in mixed_steps), mixed_steps  # prefill rows after decode rows in one step
    # the serving steps really launched the hybrid prefill past one decode row, the decode and the router
    for n in ("_prefill_kernel", "_decode_kernel", "_route_router_kernel"):
        assert served[n], f"{n}: not launched while serving"
    if mode == "XA-SSA":
        assert served["_xattn_select_kernel"]
    new = {n: keys - log["warm-up"][n] for n, keys in served.items() if keys - log["warm-up"][n]}
    assert not new, "compiled while serving, not by the warm-up: " + "; ".join(
        f"{n}: {_closest(k, log['warm-up'][n])}" for n, k in new.items()
    )


def _closest(new: set[str], warmed: set[str]) -> str:
    """The argument positions where a serving key differs from the nearest warm-up key."""
    import ast

    best = None
    for a in sorted(new):
        spec_a = ast.literal_eval(a)[0]
        for b in sorted(warmed) or [repr(([None] * len(spec_a), []))]:
            spec_b = ast.literal_eval(b)[0]
            diff = [(i, x, y) for i, (x, y) in enumerate(zip(spec_a, spec_b)) if x != y]
            if best is None or len(diff) < len(best):
                best = diff
    return "argument (index, served, warmed up) " + repr(best)
