"""Measure a trained router through the transformers engine (``elastic_vllm.hf``).

1. Realized Omega_MSR per task: prefill every held-out prompt of the mixture (``eval.jsonl.gz``) and
   read the router's decisions (argmax, no noise, one forward per prompt, batch 1).
2. Needle accuracy: ``elastic_vllm.eval.needle`` prompts at several lengths and depths, greedy
   decoding, routing on (``force="auto"``) versus every head FA (``force="all-FA"``) on the SAME
   model and prompts.

Targets of the project's issue: robust tasks' Omega_MSR >= sensitive tasks' + 0.15; needle accuracy
with routing within 2 points of all-FA.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from elastic_vllm.eval.needle import make_needle_prompt

TARGET_GAP = 0.15
TARGET_NEEDLE_DROP = 0.02


@torch.no_grad()
def omega_by_task(model, tokenizer, rows: list[dict], max_tokens: int | None = None) -> dict[str, Any]:
    """Mean realized Omega_MSR per task and per category over ``rows`` (mixture JSONL rows)."""
    state = model.elastic_state
    dev = next(model.parameters()).device
    per_task: dict[str, list[float]] = defaultdict(list)
    cat_of: dict[str, str] = {}
    for row in rows:
        text = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if max_tokens and len(ids) > max_tokens:
            continue
        model(input_ids=torch.tensor([ids], device=dev), logits_to_keep=1)
        per_task[row["task"]].append(float(state.omega_msr()[0]))
        cat_of[row["task"]] = row["category"]
    tasks = {t: sum(v) / len(v) for t, v in sorted(per_task.items())}
    cats: dict[str, list[float]] = defaultdict(list)
    for t, v in per_task.items():
        cats[cat_of[t]] += v
    by_cat = {c: sum(v) / len(v) for c, v in sorted(cats.items())}
    return {
        "omega_msr_by_task": tasks,
        "omega_msr_by_category": by_cat,
        "n_by_task": {t: len(v) for t, v in sorted(per_task.items())},
        "robust_minus_sensitive": by_cat.get("robust", float("nan")) - by_cat.get("sensitive", float("nan")),
    }


@torch.no_grad()
def needle_accuracy(
    model,
    tokenizer,
    lengths: list[int],
    per_length: int,
    haystack: str | Path = "noise",
    forces: tuple[str, ...] = ("auto", "all-FA"),
    max_new_tokens: int = 12,
    seed: int = 0,
) -> dict[str, Any]:
    """Accuracy per length and force; also the Omega_MSR the router chose on these prompts."""
    state = model.elastic_state
    dev = next(model.parameters()).device
    saved = state.cfg.force
    out: dict[str, Any] = {f: {} for f in forces}
    omegas: dict[int, list[float]] = defaultdict(list)
    try:
        for n in lengths:
            prompts = []
            for i in range(per_length):
                depth = (i + 0.5) / per_length
                prompts.append(
                    make_needle_prompt(tokenizer, n, depth=depth, seed=seed * 100_000 + n + i, haystack=haystack)
                )
            for force in forces:
                state.set_config(force=force)
                hits = 0
                for p in prompts:
                    ids = torch.tensor([tokenizer.encode(p.text(tokenizer), add_special_tokens=False)], device=dev)
                    gen = model.generate(
                        input_ids=ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=max_new_tokens,
                        do_sample=False,
                        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                    )
                    text = tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
                    hits += p.answer in text
                    if force == "auto":
                        omegas[n].append(float(state.omega_msr()[0]))
                out[force][n] = hits / len(prompts)
    finally:
        state.set_config(force=saved)
    res: dict[str, Any] = {"accuracy": {f: out[f] for f in forces}}
    for f in forces:
        res[f"mean_{f}"] = sum(out[f].values()) / len(out[f])
    res["omega_msr_by_length"] = {n: sum(v) / len(v) for n, v in omegas.items()}
    return res


def measure(
    model_dir: str | Path,
    router: str | Path,
    eval_rows: list[dict],
    lengths: list[int],
    per_length: int,
    haystack: str | Path = "noise",
    device: str = "auto",
    dtype: str = "auto",
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """Load the model with the router (and the attention config it was trained with) and run both measures."""
    from elastic_vllm.hf import load_elastic_model
    from elastic_vllm.router.checkpoint import read_meta

    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    dt = {"auto": torch.bfloat16 if dev.type == "cuda" else torch.float32, "float32": torch.float32}.get(
        dtype, torch.bfloat16
    )
    from elastic_vllm.hf.integration import config_of_router

    meta = read_meta(router)
    cfg = config_of_router(router).model_copy(update={"force": "auto"})
    t0 = time.time()
    model, tok = load_elastic_model(model_dir, cfg, router, dtype=dt, device=dev)
    res: dict[str, Any] = {
        "router": str(router),
        "attention": meta.attention,
        "device": str(dev) if dev.type != "cuda" else torch.cuda.get_device_name(dev),
        "dtype": str(dt),
    }
    res["omega"] = omega_by_task(model, tok, eval_rows, max_tokens)
    res["needle"] = needle_accuracy(model, tok, lengths, per_length, haystack)
    gap = res["omega"]["robust_minus_sensitive"]
    # accuracies are counts / n: round away the float noise of the difference (0.94 - 0.92 = 0.0200...01)
    drop = round(res["needle"]["mean_all-FA"] - res["needle"]["mean_auto"], 9)
    res["targets"] = {
        "robust_minus_sensitive": {"value": gap, "target": f">= {TARGET_GAP}", "met": gap >= TARGET_GAP},
        "needle_drop_vs_all_fa": {
            "value": drop,
            "target": f"<= {TARGET_NEEDLE_DROP}",
            "met": drop <= TARGET_NEEDLE_DROP,
        },
    }
    res["wall_s"] = round(time.time() - t0, 1)
    return res


def format_report(res: dict[str, Any]) -> str:
    """Markdown tables of a ``measure`` result."""
    lines = ["| task | Omega_MSR | n |", "|---|---|---|"]
    om = res["omega"]
    for t, v in om["omega_msr_by_task"].items():
        lines.append(f"| {t} | {v:.3f} | {om['n_by_task'][t]} |")
    for c, v in om["omega_msr_by_category"].items():
        lines.append(f"| **{c}** | **{v:.3f}** | |")
    nd = res["needle"]["accuracy"]
    lengths = sorted(next(iter(nd.values())))
    lines += ["", "| needle accuracy | " + " | ".join(str(n) for n in lengths) + " | mean |"]
    lines.append("|---" * (len(lengths) + 2) + "|")
    for f, accs in nd.items():
        lines.append(
            f"| {f} | " + " | ".join(f"{accs[n]:.2f}" for n in lengths) + f" | {res['needle'][f'mean_{f}']:.3f} |"
        )
    lines.append("")
    for k, t in res["targets"].items():
        lines.append(f"- {k}: {t['value']:.3f} (target {t['target']}): {'MET' if t['met'] else 'NOT MET'}")
    return "\n".join(lines)
