#!/usr/bin/env python3
"""Does the router's input carry the task? A linear probe on the pooled prompt keys, per pooling.

    python3 benchmarks/router_input_probe.py --out benchmarks/results/router-input-probe-smollm2-cpu.json  # ~35 min, 2 CPU cores

The router of a (layer, KV head) sees one vector: that head's pre-RoPE keys pooled over the prompt (the mean over
its first and last 100 tokens). Whether a retrained router could give a retrieval prompt and the summary of the same
haystack different sparsity depends first on whether that vector differs by task more than by haystack. This
measures it on the served generalization suite's prompts (``elastic_vllm/eval/heldout.py``: the 14 retrieval
families and the 6 summary families, chat prompts of the same form on the same 6 haystacks, only the task
differing), the demo model in float32 through transformers:

    per (layer, KV head) and pooling: a logistic regression (L2) on the 64-d pooled key, trained on 5 haystacks,
    scored (AUC, retrieval vs summary) on the 6th; the mean of the 6 held-out AUCs per head

Poolings: ``boundary`` (the shipped routers' input), and ``tail`` variants that add weight on the prompt's last
``m`` tokens (the question and the chat template's closing tokens): pooled = (1 - a) x boundary + a x mean(last m).
A pooling that raises the held-out AUC of many heads is a router input worth retraining on (the router is a
small per-head MLP of the same vector); one that does not, is not.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from _harness import ROOT, environment, log, write_json

N_BOUNDARY = 100  # the router's boundary tokens (router/model.py)
TAILS = ((16, 0.5), (32, 0.5), (32, 0.9), (64, 0.5))  # (m, a)
L2 = 1e-2  # on standardized 64-d features, ~200 samples a fold: keeps every fold's fit from separating by noise


# the held-out haystack's summaries are scored reworded: a probe that only learned the suite's one summary sentence
# (heldout.SUMMARY_Q) scores chance on these
REWORDED = (
    "In a few sentences, what is the {what} above about?",
    "Give me a short overview of the {what} above.",
    "Briefly describe what the {what} above contains.",
)


def reworded(content: str, question: str, index: int) -> str:
    """The summary prompt with its instruction replaced by one of ``REWORDED`` (by prompt index)."""
    from elastic_vllm.eval.heldout import SUMMARY_Q

    head, tail = SUMMARY_Q.split("{what}")
    what = question.removeprefix(head).removesuffix(tail)
    if what == question or question not in content:
        raise ValueError(f"not a summary instruction of heldout.SUMMARY_Q's form: {question!r}")
    return content.replace(question, REWORDED[index % len(REWORDED)].format(what=what))


def poolings() -> list[tuple[str, int, float]]:
    return [("boundary", 0, 0.0)] + [(f"tail{m}-a{a:g}", m, a) for m, a in TAILS]


def pool(keys, how: tuple[str, int, float]):
    """keys [T, L, H, d] (one prompt) -> [L, H, d]: the routers' boundary mean (``router.model.boundary_positions``),
    mixed with the mean of the last m tokens."""
    from elastic_vllm.router.model import boundary_positions

    _, m, a = how
    T = keys.shape[0]
    base = keys[boundary_positions(T, N_BOUNDARY)].mean(0)
    return base if m == 0 else (1 - a) * base + a * keys[T - m :].mean(0)


def capture_keys(model, ids):
    """Pre-RoPE keys of every layer for one prompt: [T, L, H_kv, d] (the k_proj outputs)."""
    import torch

    cfg = model.config
    hkv = cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    got: list = []
    hooks = [
        layer.self_attn.k_proj.register_forward_hook(lambda mod, inp, out: got.append(out[0].detach()))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([k.view(-1, hkv, d) for k in got], 1).float()


def auc(scores, labels) -> float:
    """AUC of scores for label 1 over label 0 (ties count half): ``query_guard.auc`` on the two groups."""
    import torch
    from query_guard import auc as auc_groups

    s, y = torch.as_tensor(scores, dtype=torch.float64), torch.as_tensor(labels, dtype=torch.bool)
    return auc_groups(s[y], s[~y])


def fit_logistic(x, y, l2: float = L2, steps: int = 60):
    """x [N, F], y [N] in {0, 1} -> (w, b), L2-regularized logistic regression by LBFGS."""
    import torch

    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros((), requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), b.detach()


def held_out_auc(feats, labels, groups, test_feats=None) -> tuple[float, list[float]]:
    """feats [N, F]: leave-one-group-out AUC per group (standardized by the training fold), and their mean;
    ``test_feats`` (default ``feats``): the rows the held-out group is scored on (its prompts reworded)."""
    import torch

    test_feats = feats if test_feats is None else test_feats
    y = torch.tensor(labels, dtype=torch.float32)
    out = []
    for g in sorted(set(groups)):
        te = torch.tensor([x == g for x in groups])
        tr = ~te
        mu, sd = feats[tr].mean(0), feats[tr].std(0).clamp(min=1e-6)
        w, b = fit_logistic((feats[tr] - mu) / sd, y[tr])
        s = ((test_feats[te] - mu) / sd) @ w + b
        out.append(auc(s.tolist(), [int(v) for v in y[te].tolist()]))
    return sum(out) / len(out), out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/router-input-probe-smollm2-cpu.json")
    p.add_argument("--per-cell", type=int, default=10, help="prompts of every retrieval family")
    p.add_argument("--summary-per-cell", type=int, default=20, help="prompts of every summary family")
    p.add_argument("--prompt-tokens", type=int, default=1200, help="the served suite's default")
    p.add_argument("--model", type=Path, help="default: the demo model")
    a = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from elastic_vllm.eval import heldout as H
    from elastic_vllm.models import fetch_demo_model

    torch.manual_seed(0)
    model_dir = a.model or fetch_demo_model()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cells = list(H.CELLS) + [("summarize", h, "after") for h in H.HAYSTACKS]
    prompts = H.build_prompts(cells, a.per_cell, tok, a.prompt_tokens, 0, a.summary_per_cell)
    t0 = time.perf_counter()
    pooled: dict[str, list] = {name: [] for name, _, _ in poolings()}
    test: dict[str, list] = {name: [] for name, _, _ in poolings()}  # summaries reworded
    labels, groups, families, lengths = [], [], [], []

    def keys_of(content: str):
        text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                       tokenize=False)  # fmt: skip
        ids = tok.encode(text, add_special_tokens=False)
        return capture_keys(model, ids), len(ids)

    for i, pr in enumerate(prompts):
        keys, n_ids = keys_of(pr.content)
        other = keys if pr.category == "sensitive" else keys_of(reworded(pr.content, pr.question, pr.index))[0]
        for how in poolings():
            pooled[how[0]].append(pool(keys, how))
            test[how[0]].append(pool(other, how))
        labels.append(int(pr.category == "sensitive"))
        groups.append(pr.haystack)
        families.append(pr.family)
        lengths.append(n_ids)
        if i % 40 == 0:
            log(f"{i}/{len(prompts)} prompts ({time.perf_counter() - t0:.0f} s)")
    L, Hkv = pooled["boundary"][0].shape[:2]
    res: dict = {}
    for name, m, a_ in poolings():
        x, xt = torch.stack(pooled[name]), torch.stack(test[name])  # [N, L, H, d]
        hays = sorted(set(groups))
        res[name] = {"tail_tokens": m, "tail_weight": a_}
        for key, tx in (("same", x), ("reworded", xt)):
            per_head = [
                [held_out_auc(x[:, ly, h], labels, groups, tx[:, ly, h]) for h in range(Hkv)] for ly in range(L)
            ]
            aucs = [v for row in per_head for v, _ in row]
            res[name][key] = {
                "auc_mean": sum(aucs) / len(aucs),
                "auc_median": sorted(aucs)[len(aucs) // 2],
                "heads_auc_ge_0.9": sum(v >= 0.9 for v in aucs),
                "heads_auc_ge_0.75": sum(v >= 0.75 for v in aucs),
                "auc_max": max(aucs),
                "held_out_auc_by_haystack": {
                    g: sum(f[k] for rr in per_head for _, f in rr) / (L * Hkv) for k, g in enumerate(hays)
                },
                "auc_per_head": [[round(v, 4) for v, _ in row] for row in per_head],
            }
            r = res[name][key]
            log(f"{name} ({key}): mean held-out AUC {r['auc_mean']:.3f}, heads >= 0.9: {r['heads_auc_ge_0.9']}")
    counts = {f: families.count(f) for f in dict.fromkeys(families)}
    d = {
        "benchmark": "router_input_probe",
        "environment": environment(
            ("torch", "transformers"), ["python3", "benchmarks/router_input_probe.py", *(argv or [])]
        ),
        "model": str(model_dir),
        "prompts": {
            "families": counts,
            "retrieval": sum(labels),
            "summary": len(labels) - sum(labels),
            "tokens_min_max": [min(lengths), max(lengths)],
            "prompt_tokens": a.prompt_tokens,
        },
        "heads": L * Hkv,
        "probe": {
            "model": "logistic regression per (layer, KV head), L2 on standardized features",
            "l2": L2,
            "folds": "leave one haystack out (6)",
            "metric": "AUC, retrieval vs summary",
        },
        "poolings": res,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    write_json(a.out, d)
    a.out.with_suffix(".md").write_text(markdown(d))
    print(markdown(d))
    return 0


def markdown(d: dict) -> str:
    first = next(iter(d["poolings"].values()))["same"]
    hays = list(first["held_out_auc_by_haystack"])
    lines = [
        "# Router input probe: retrieval vs summary from the pooled prompt keys",
        "",
        f"torch {d['environment'].get('torch')}, transformers {d['environment'].get('transformers')}, commit "
        f"{d['environment']['git_commit']}. Command: `{d['environment']['command']}`.",
        "",
        f"{d['prompts']['retrieval']} retrieval and {d['prompts']['summary']} summary prompts "
        f"({d['prompts']['tokens_min_max'][0]}-{d['prompts']['tokens_min_max'][1]} tokens); per (layer, KV head) a "
        f"logistic regression on its pooled key, trained on 5 haystacks, AUC on the 6th ({d['heads']} heads); "
        "`reworded`: the held-out haystack's summaries ask in words the training folds never saw.",
        "",
        "| pooling | held-out summaries | mean AUC | median | heads >= 0.9 | heads >= 0.75 | best head | "
        + " | ".join(f"held out: {h}" for h in hays)
        + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(hays),
    ]
    for name, rr in d["poolings"].items():
        for key in ("same", "reworded"):
            r = rr[key]
            lines.append(
                f"| {name} | {key} | {r['auc_mean']:.3f} | {r['auc_median']:.3f} | {r['heads_auc_ge_0.9']} | "
                f"{r['heads_auc_ge_0.75']} | {r['auc_max']:.3f} | "
                + " | ".join(f"{r['held_out_auc_by_haystack'][h]:.3f}" for h in hays)
                + " |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
