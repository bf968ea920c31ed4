"""Do the two engines agree? The same prompts through vLLM (elastic backend) and transformers (``elastic_vllm.hf``).

Both run float32 greedy decoding from the same token ids with the same ElasticConfig and router; per
prompt we compare the router's decisions (vLLM's once-per-request ``RoutingEvent`` vs the transformers
model's ``last_routing``) and the generated tokens (exact match, and the common-prefix length: greedy
decoding of two float32 engines may part after a near-tie, and then the rest differs legitimately).

vLLM runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager, without prefix caching and with a
token budget of the whole prompt (no chunked prefill), so routing happens on complete prompts as in
transformers. Intended for the CPU build of vLLM (``pip install -e .[cpu]``).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import torch

from elastic_vllm.config import ElasticConfig


def _vllm_generate(model_dir, router, cfg: ElasticConfig, prompts: list[list[int]], max_new: int, max_len: int):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from elastic_vllm.vllm_plugin import observe
    from elastic_vllm.vllm_plugin.plugin import register

    register()
    observe.clear()
    elastic = cfg.model_dump()
    elastic["router_path"] = str(router) if router else None
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        attention_backend="ELASTIC",
        additional_config={"elastic": elastic},
        max_model_len=max_len,
        max_num_batched_tokens=max_len,
        max_num_seqs=max(1, len(prompts)),
        enable_prefix_caching=False,
        kv_cache_memory_bytes=256 << 20,
        seed=0,
    )
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        ids = [o.request_id for o in outs]
        events = observe.events()
        routing = []
        for rid, p in zip(ids, prompts):
            got = [
                e for e in events if e.req_id == rid or e.req_id.startswith(f"{rid}-") or rid.startswith(f"{e.req_id}")
            ]
            if len(got) != 1:
                got = [e for e in events if e.prompt_len == len(p)]
            routing.append(got[0].decisions.bool() if len(got) == 1 else None)
        forward_calls = observe.COUNTERS.forward_calls
    finally:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # best effort: an in-process engine core may not need it
            pass
        del llm
        gc.collect()
    return tokens, routing, forward_calls


def _hf_generate(model_dir, router, cfg: ElasticConfig, prompts: list[list[int]], max_new: int, eos: list[int]):
    from transformers import GenerationConfig

    from elastic_vllm.hf import load_elastic_model

    model, tok = load_elastic_model(model_dir, cfg, router, dtype=torch.float32, device="cpu")
    gc_ = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    tokens, routing = [], []
    with torch.no_grad():
        for p in prompts:  # one at a time: no padding, the plainest path
            ids = torch.tensor([p])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc_)
            tokens.append(out[0, len(p) :].tolist())
            routing.append(model.elastic_state.last_routing[0].cpu())
    return tokens, routing


def vllm_agreement(
    model_dir: str | Path,
    router: str | Path | None,
    records: list[dict],
    cfg: ElasticConfig,
    max_new_tokens: int = 16,
    log=print,
) -> dict:
    """Per-prompt comparison + summary {n, routing_equal, tokens_equal, mean_common_prefix, vllm_forward_calls}."""
    from transformers import AutoTokenizer

    if not records:
        raise ValueError("no prompts to compare")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [tok.encode(r["input"], add_special_tokens=False) for r in records]
    max_len = max(len(p) for p in prompts) + max_new_tokens + 16
    eos = [tok.eos_token_id]
    log(f"vLLM check: {len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens)")
    v_tok, v_route, calls = _vllm_generate(model_dir, router, cfg, prompts, max_new_tokens, max_len)
    h_tok, h_route = _hf_generate(model_dir, router, cfg, prompts, max_new_tokens, eos)
    rows = []
    for r, vt, ht, vr, hr in zip(records, v_tok, h_tok, v_route, h_route):
        vt = [t for t in vt if t not in eos]
        ht = [t for t in ht if t not in eos]
        common = 0
        for a, b in zip(vt, ht):
            if a != b:
                break
            common += 1
        rows.append(
            {
                "task": r["task"],
                "length": r["length"],
                "index": r["index"],
                "prompt_tokens": len(tok.encode(r["input"], add_special_tokens=False)),
                "routing_equal": vr is not None and bool(torch.equal(vr.cpu(), hr.cpu())),
                "routing_found": vr is not None,
                "omega_msr_vllm": None if vr is None else float((~vr).float().mean()),
                "omega_msr_hf": float((~hr).float().mean()),
                "tokens_equal": vt == ht,
                "common_prefix": common,
                "vllm_text": tok.decode(vt)[:200],
                "hf_text": tok.decode(ht)[:200],
            }
        )
    n = len(rows)
    summary = {
        "n": n,
        "routing_equal": sum(x["routing_equal"] for x in rows) / n,
        "tokens_equal": sum(x["tokens_equal"] for x in rows) / n,
        "mean_common_prefix": sum(x["common_prefix"] for x in rows) / n,
        "max_new_tokens": max_new_tokens,
        "vllm_forward_calls": calls,
    }
    return {"summary": summary, "prompts": rows, "config": cfg.model_dump()}


def main(argv: list[str] | None = None) -> int:
    """``python3 -m elastic_vllm.eval.agreement --model DIR --router DIR --n 4 --out FILE.json`` (CPU)."""
    import argparse
    import json
    import sys

    from elastic_vllm.eval.engine import DEFAULT_DATA, base_config, provenance
    from elastic_vllm.eval.ruler import read_jsonl

    p = argparse.ArgumentParser(prog="python3 -m elastic_vllm.eval.agreement", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--router", help="router folder (default: none, then --force decides)")
    p.add_argument("--force", default="auto", choices=["auto", "all-FA", "all-SA"])
    p.add_argument("--data", default=DEFAULT_DATA[0], help="RULER records (the shortest prompt of each task is used)")
    p.add_argument("--n", type=int, default=4, help="prompts (one per RULER task, shortest first)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--out", required=True, help="JSON file")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    cfg, router_meta = base_config(a.router, None, None)
    cfg = ElasticConfig.parse({**cfg.model_dump(), "force": a.force})
    best: dict[str, dict] = {}
    for r in read_jsonl(a.data):
        if r["task"] not in best or r["prompt_tokens"] < best[r["task"]]["prompt_tokens"]:
            best[r["task"]] = r
    records = sorted(best.values(), key=lambda r: r["prompt_tokens"])[: a.n]
    res = vllm_agreement(a.model, a.router, records, cfg, a.max_new_tokens)
    res["provenance"] = provenance(list(getattr(sys, "orig_argv", sys.argv)), torch.device("cpu"))
    res["router_meta"] = router_meta
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res["summary"]))
    return 0 if res["summary"]["routing_equal"] == 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
