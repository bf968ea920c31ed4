"""The retrieval-head ranking a router checkpoint stores, for the fail-safe floor (``ElasticConfig.fa_floor``).

KV heads ranked by the attention mass they put on the needle's value tokens while the model reads out the
answer, under dense attention (``eval.baselines.retrieval_scores``), on calibration needle prompts that are
not evaluation prompts: by default the static hybrid's calibration recipe (one number hidden in the second
half of RULER's Paul Graham essays; RULER's own haystacks come from the start) at 4096 and 8192 tokens, 8
prompts each. Measured when a router is trained (``train.loop``) and by ``elastic-vllm router-rank`` for an
existing checkpoint; stored in router.json (``RouterMeta.retrieval``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from elastic_vllm.router.checkpoint import RetrievalRanking

DEFAULT_LENGTHS = (4096, 8192)
DEFAULT_PER_LENGTH = 8
# eval.prepare's calibration seed (its seed 42 + 1000): the same prompts as the committed static-hybrid rows
DEFAULT_SEED = 1042
ESSAYS = "RULER's Paul Graham essays, second half"


def calibration_records(
    tok, lengths=DEFAULT_LENGTHS, per_length: int = DEFAULT_PER_LENGTH, seed: int = DEFAULT_SEED,
    haystack: str | Path | None = None,
) -> tuple[list[dict], dict[str, Any]]:  # fmt: skip
    """(needle records of ``eval.baselines.calibration_prompts``, their description for the checkpoint).
    ``haystack``: a text file to hide the needles in instead of the essays."""
    from elastic_vllm.eval.baselines import calibration_prompts

    if haystack is None:
        from elastic_vllm.eval.robust import essay_text

        essays = essay_text()
        text, source = essays[len(essays) // 2 :], ESSAYS
    else:
        text, source = Path(haystack).read_text(), Path(haystack).name
    records = calibration_prompts(tok, text, tuple(lengths), per_length, seed=seed)
    digest = hashlib.sha256(json.dumps([r["input"] for r in records]).encode()).hexdigest()
    desc = {
        "prompts": len(records),
        "lengths": list(lengths),
        "per_length": per_length,
        "seed": seed,
        "haystack": source,
        "recipe": "eval.baselines.calibration_prompts: a number stated once at depth (i + 0.5) / per_length, "
        "asked for at the end; the answer teacher-forced",
        "inputs_sha256": digest,
    }
    return records, desc


def measure_ranking(model, tok, records: list[dict], desc: dict[str, Any], device=None, log=None) -> RetrievalRanking:
    """The ranking of ``model`` (a transformers causal LM, dense attention) on calibration ``records``."""
    from elastic_vllm.eval.baselines import retrieval_scores

    was_training = model.training
    model.eval()
    try:
        scores = retrieval_scores(model, tok, records, device, log)
    finally:
        model.train(was_training)
    if not torch.isfinite(scores).all():
        raise RuntimeError("the retrieval scores hold NaN or inf values")
    return RetrievalRanking(scores=scores.tolist(), calibration=desc)


def rank_router(
    router_dir: str | Path, model_dir: str | Path, lengths=DEFAULT_LENGTHS, per_length: int = DEFAULT_PER_LENGTH,
    seed: int = DEFAULT_SEED, haystack: str | Path | None = None, device: str = "cpu", log=None,
) -> RetrievalRanking:  # fmt: skip
    """Measure the ranking with the router's backbone ``model_dir`` (float32) and store it in ``router_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from elastic_vllm.router.checkpoint import BackboneShape, add_ranking, check_shape, read_meta

    meta = read_meta(router_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    check_shape(meta, BackboneShape.from_hf_config(model.config), str(model_dir), router_dir)
    model.to(device).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    records, desc = calibration_records(tok, lengths, per_length, seed, haystack)
    desc = {**desc, "model": Path(model_dir).name, "dtype": "float32", "device": str(device)}
    ranking = measure_ranking(model, tok, records, desc, device, log)
    add_ranking(router_dir, ranking)
    return ranking
