"""Static hybrid baseline (DuoAttention / PruLong spirit): rank KV heads ONCE, make the same heads SA for all inputs.

Retrieval score of a KV head = attention mass it puts on the needle's value tokens while the model
reads out the answer, under DENSE attention, averaged over a small calibration set of needle prompts
(built by ``eval/needle.py`` on essay text, never the evaluation prompts)::

    score[l, h] = mean over prompts, over answer positions t, over the G query heads of KV head h of
                  sum_{j in needle value tokens} softmax(q_t . K^T * scale)[j]

The answer is teacher-forced after the prompt (prompt + " " + value): query t is the position whose
next token is an answer token, so the scores are those of the heads that copy the needle (the
"retrieval heads" measurement on SmolLM2-135M: the top 9 of its 90 KV heads hold 82% of the mass).

``static_routing(scores, omega)`` makes the ``round(omega * L * H_kv)`` lowest-scoring heads SA.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from elastic_vllm.hf.integration import set_attn_implementation

CALIB_IMPL = "elastic_calib"


@dataclass
class _Calib:
    """What the calibration attention function accumulates during one forward."""

    needle: torch.Tensor  # bool [B, K] needle value tokens
    q_from: torch.Tensor  # long [B] first scored query position (the last prompt token)
    q_to: torch.Tensor  # long [B] one past the last scored query position
    mass: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, Hkv]


_CURRENT: _Calib | None = None


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    B, H, T, D = x.shape
    return x[:, :, None].expand(B, H, n, T, D).reshape(B, H * n, T, D) if n > 1 else x


def calib_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Dense causal attention (unpadded rows) that also records the needle mass of the answer queries."""
    B, Hq, T, D = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    scale = D**-0.5 if scaling is None else scaling
    k, v = _repeat_kv(key, G), _repeat_kv(value, G)
    out = F.scaled_dot_product_attention(query, k, v, is_causal=T > 1, scale=scale)
    c = _CURRENT
    if c is not None and T > 1:
        n_q = int((c.q_to - c.q_from).max())
        pos = c.q_from[:, None] + torch.arange(n_q, device=query.device)[None]  # [B, nq]
        valid_q = pos < c.q_to[:, None]
        pos = pos.clamp(max=T - 1)
        qs = torch.gather(query, 2, pos[:, None, :, None].expand(B, Hq, n_q, D))  # [B, Hq, nq, D]
        s = torch.einsum("bhqd,bhkd->bhqk", qs.float(), k.float()) * scale
        causal = torch.arange(T, device=query.device)[None, None, :] <= pos[:, :, None]  # [B, nq, K]
        p = torch.softmax(s.masked_fill(~causal[:, None], float("-inf")), dim=-1)
        m = (p * c.needle[:, None, None, :].float()).sum(-1)  # [B, Hq, nq]
        m = (m * valid_q[:, None].float()).sum(-1) / valid_q.sum(-1, keepdim=True).float()
        c.mass[int(module.layer_idx)] = m.view(B, Hkv, G).mean(-1)
    return out.transpose(1, 2).contiguous(), None


def calibration_prompts(
    tokenizer, essay: str, lengths=(4096, 8192), per_length: int = 8, seed: int = 1234
) -> list[dict]:
    """Needle prompts on essay stretches (``eval/needle.py``), with the needle value's character span.

    Records: {"task": "calib", "length", "index", "input", "outputs": [value], "needle_span": [a, b], "prompt_tokens"}.
    """
    import tempfile

    from elastic_vllm.eval.needle import make_needle_prompt

    rng = random.Random(seed)
    rows = []
    with tempfile.TemporaryDirectory() as td:
        for length in lengths:
            for i in range(per_length):
                # a stretch of ~6 characters per token is plenty of haystack for ``length`` tokens
                n_chars = 6 * length
                start = rng.randrange(0, max(1, len(essay) - n_chars))
                hay = Path(td) / f"hay-{length}-{i}.txt"
                hay.write_text(essay[start : start + n_chars])
                depth = (i + 0.5) / per_length
                np_ = make_needle_prompt(tokenizer, length - 64, depth=depth, seed=seed + 97 * i + length, haystack=hay)
                text = np_.text(tokenizer)
                at = text.rfind(f"is: {np_.answer}.")
                if at < 0:
                    raise RuntimeError("needle sentence not found in the calibration prompt")
                a = at + len("is: ")
                rows.append(
                    {
                        "task": "calib",
                        "length": length,
                        "index": i,
                        "input": text,
                        "outputs": [np_.answer],
                        "needle_span": [a, a + len(np_.answer)],
                        "prompt_tokens": len(tokenizer.encode(text, add_special_tokens=False)),
                    }
                )
    return rows


@torch.no_grad()
def retrieval_scores(model, tokenizer, records: list[dict], device=None, log=None) -> torch.Tensor:
    """Mean needle mass per KV head, float32 [L, H_kv], from calibration ``records`` (one forward each).

    The model's attention implementation is switched to the recording one for the duration and
    restored after (an elastic model keeps its hooks; they do not change dense attention).
    """
    global _CURRENT
    from transformers import AttentionInterface

    AttentionInterface.register(CALIB_IMPL, calib_attention_forward)
    cfg = getattr(model.config, "text_config", None) or model.config
    L, Hkv = cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    device = device or next(model.parameters()).device
    prev = model.config._attn_implementation
    total = torch.zeros(L, Hkv, dtype=torch.float64)
    set_attn_implementation(model, CALIB_IMPL)
    try:
        for n, r in enumerate(records):
            text = r["input"]
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ans = tokenizer.encode(" " + r["outputs"][0], add_special_tokens=False)
            ids = torch.tensor([enc["input_ids"] + ans], device=device)
            a, b = r["needle_span"]
            needle = torch.zeros(1, ids.shape[1], dtype=torch.bool, device=device)
            for t, (s, e) in enumerate(enc["offset_mapping"]):
                if s < b and e > a:
                    needle[0, t] = True
            if not bool(needle.any()):
                raise RuntimeError(f"calibration prompt {n}: the needle span maps to no token")
            P = len(enc["input_ids"])
            _CURRENT = _Calib(
                needle=needle,
                q_from=torch.tensor([P - 1], device=device),
                q_to=torch.tensor([P - 1 + len(ans)], device=device),
            )
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
            if len(_CURRENT.mass) != L:
                raise RuntimeError(f"calibration saw {len(_CURRENT.mass)} of {L} layers")
            total += torch.stack([_CURRENT.mass[i][0] for i in range(L)]).double().cpu()
            if log:
                log(f"calibration {n + 1}/{len(records)} ({P} tokens)")
    finally:
        _CURRENT = None
        set_attn_implementation(model, prev)
    return (total / max(len(records), 1)).float()


def static_routing(scores: torch.Tensor, omega: float) -> torch.Tensor:
    """bool [L, H_kv] (True = FA): the ``round(omega * L * H_kv)`` lowest-scoring heads become SA.

    Ties are broken by flat head index (stable sort), so the routing is deterministic.
    """
    if not 0.0 <= omega <= 1.0:
        raise ValueError(f"omega must be in [0, 1], got {omega}")
    flat = scores.flatten().float()
    n_sa = round(omega * flat.numel())
    order = torch.argsort(flat, stable=True)  # lowest first
    is_fa = torch.ones(flat.numel(), dtype=torch.bool)
    is_fa[order[:n_sa]] = False
    return is_fa.view_as(scores)
