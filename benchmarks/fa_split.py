#!/usr/bin/env python3
"""Hybrid prompt steps: the fused kernel for every head, or the FA heads on vLLM's FlashAttention (one call per KV
head, ``ops.fa_heads_attention``) and the fused kernel for the SA heads only (``skip_fa``)?

    python3 benchmarks/fa_split.py --out benchmarks/results/fa-split-h200.json      # GPU, staged vLLM
    python3 benchmarks/fa_split.py --cpu-dry --out /tmp/fa-split.json              # plumbing, no GPU

One layer's attention as the backend runs it (``ops.triton_attention``, vLLM's interleaved [blocks, 16, Hkv, 2d]
cache), for the Llama-3.1-8B attention (32 / 8 heads, d 128) and the demo model's (SmolLM2-135M: 9 / 3, d 64), on
the prompt steps vLLM schedules at its default chunk of 8192 tokens: one whole prompt of 1K-8K, eight 1K prompts,
and the last chunk of a 12K-128K prompt. The SA share (the first n KV heads SSA, the rest FA) runs 0 to 1: the
host does not know a step's routing (it is decided on the device), so the split costs what it costs at every
share. Times are ``do_bench`` medians of eager calls: the host's launches are inside them, as in vLLM's eager
attention between graph pieces. Every split output is checked against the fused kernel's (NaN-poisoned buffers,
relative error under the warm-up's admission tolerance) before it is timed. The state's ``FA_SPLIT_MIN_SEQ`` is
read off this table: the shortest context from which the split is not slower at any share.
"""

from __future__ import annotations

import argparse
import os
import sys

from _harness import bench, environment, log, write_json

SHAPES = {"llama": (32, 8, 128), "demo": (9, 3, 64)}
SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)
SINK, WINDOW, BS = 128, 2048, 16


def cases(dry: bool) -> list[tuple[str, list[int], list[int]]]:
    """(name, seq_lens, query_lens) of one prompt step."""
    if dry:
        return [("1x96", [96], [96]), ("2x48", [48, 48], [48, 48]), ("ctx160 q64", [160], [64])]
    one = [(f"1x{s // 1024}K", [s], [s]) for s in (1024, 2048, 4096, 8192)]
    chunks = [(f"ctx{c // 1024}K q8K", [c], [8192]) for c in (16384, 32768, 65536, 131072)]
    # a 12K prompt's last chunk (4K after 8K): between the whole 8K prompt and the 16K contexts
    return [*one, ("8x1K", [1024] * 8, [1024] * 8), ("ctx12K q4K", [12288], [4096]), *chunks]


def step_inputs(torch, seq_lens, query_lens, hq, hkv, d, dev, dt, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    nblk = [(s + BS - 1) // BS for s in seq_lens]
    total = sum(nblk) + 1
    kv = torch.randn(total, BS, hkv, 2 * d, device=dev, dtype=dt, generator=g)
    kc, vc = kv[..., :d], kv[..., d:]  # vLLM's layout for the elastic backend (compat.split_kv_cache)
    perm = (torch.randperm(total - 1, device=dev, generator=g) + 1).to(torch.int32)
    bt = torch.zeros(len(seq_lens), max(nblk), device=dev, dtype=torch.int32)
    o = 0
    for i, n in enumerate(nblk):
        bt[i, :n] = perm[o : o + n]
        o += n
    q = torch.randn(sum(query_lens), hq, d, device=dev, dtype=dt, generator=g)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    sl = torch.tensor(seq_lens, device=dev, dtype=torch.int32)
    return q, kc, vc, bt, qsl, sl


def dense_kernel(torch, dev, dt, d):
    """vLLM's FlashAttention as the warm-up admits it, or the PyTorch reference under --cpu-dry."""
    if dev.type != "cuda":
        from elastic_vllm.reference.attention import dense_paged_attention

        return dense_paged_attention, "reference.dense_paged_attention (CPU plumbing)"
    from elastic_vllm.vllm_plugin import compat

    fn, what = compat.flash_attn_dense(dt, d)
    if fn is None:
        raise RuntimeError(f"no FlashAttention to split onto: {what}")
    return fn, what


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="llama,demo")
    ap.add_argument("--shares", default=",".join(map(str, SHARES)), help="SA shares of the KV heads")
    ap.add_argument("--cpu-dry", action="store_true", help="toy sizes under TRITON_INTERPRET=1 (plumbing check)")
    args = ap.parse_args()
    if args.cpu_dry:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from elastic_vllm.vllm_plugin.ops import AttnParams, triton_attention
    from elastic_vllm.vllm_plugin.warmup import DENSE_CHECK_RTOL

    if not args.cpu_dry and not torch.cuda.is_available():
        print("no CUDA device (use --cpu-dry for a plumbing check)")
        return 2
    dev = torch.device("cpu" if args.cpu_dry else "cuda")
    dt = torch.float16 if args.cpu_dry else torch.bfloat16
    sink, window = (8, 32) if args.cpu_dry else (SINK, WINDOW)
    report = {"env": environment(("torch", "triton", "vllm")), "rows": [],
              "config": {"sink": sink, "window": window, "block_size": BS, "dtype": str(dt),
                         "rtol": DENSE_CHECK_RTOL}}  # fmt: skip
    log(report["env"])
    for shape in args.shapes.split(","):
        hq, hkv, d = SHAPES[shape]
        fn, what = dense_kernel(torch, dev, dt, d)
        report["config"]["dense"] = what
        p = AttnParams(scale=d**-0.5, sink=sink, window=window, xattn_stride=8, xattn_block=128, xattn_threshold=0.9)
        for name, seq_lens, query_lens in cases(args.cpu_dry):
            q, kc, vc, bt, qsl, sl = step_inputs(torch, seq_lens, query_lens, hq, hkv, d, dev, dt)
            mq, ms = max(query_lens), max(seq_lens)
            for share in map(float, args.shares.split(",")):
                n_sa = round(share * hkv)
                hm = torch.tensor([[1 if h < n_sa else 0 for h in range(hkv)]] * len(seq_lens), device=dev,
                                  dtype=torch.int32)  # fmt: skip
                outs = {k: torch.full_like(q, float("nan")) for k in ("fused", "split")}

                def run(kind, hm=hm, outs=outs, q=q, kc=kc, vc=vc, bt=bt, qsl=qsl, sl=sl, mq=mq, ms=ms, p=p, fn=fn):
                    return triton_attention(q, kc, vc, bt, qsl, sl, hm, p, outs[kind], 0, 0, mq, ms, False, None,
                                            fn if kind == "split" else None)  # fmt: skip

                a, b = run("fused").float(), run("split").float()
                err = float((b - a).norm() / a.norm())
                row = {"shape": shape, "case": name, "context": seq_lens[0], "rows": len(seq_lens), "q_tokens":
                       sum(query_lens), "share": share, "rel_err": err, "ok": err < DENSE_CHECK_RTOL}  # fmt: skip
                if row["ok"]:
                    row["fused_ms"] = bench(lambda: run("fused"), cuda=dev.type == "cuda")["ms"]
                    row["split_ms"] = bench(lambda: run("split"), cuda=dev.type == "cuda")["ms"]
                    row["x_split"] = row["fused_ms"] / row["split_ms"]  # > 1: the split is faster
                report["rows"].append(row)
                log(row)
            del q, kc, vc, bt
            write_json(args.out, report)
    bad = [r for r in report["rows"] if not r["ok"]]
    summary(report["rows"])
    write_json(args.out, report)
    log(f"{len(report['rows'])} rows, {len(bad)} failed the check -> {args.out}")
    return 1 if bad else 0


def summary(rows) -> None:
    print("\nfused / split ms (x > 1: the split is faster)")
    for r in rows:
        if r["ok"]:
            print(f"  {r['shape']:<5} {r['case']:<12} SA {r['share']:<4} fused {r['fused_ms']:8.3f}"
                  f"  split {r['split_ms']:8.3f}  x {r['x_split']:5.2f}")  # fmt: skip
        else:
            print(f"  {r['shape']:<5} {r['case']:<12} SA {r['share']:<4} CHECK FAILED rel_err {r['rel_err']:.3g}")


if __name__ == "__main__":
    sys.exit(main())
