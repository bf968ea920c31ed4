"""The accuracy harness's engine and what every suite of it shares (``harness`` for RULER and the robust tasks,
``generalization`` for the held-out families, ``agreement`` for vLLM vs transformers): the methods, one elastic
transformers model that switches between them, the base config from a router checkpoint, and the run record.
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastic_vllm.config import ElasticConfig
from elastic_vllm.sparsity import omega_esr

# the committed prompts of the demo model (a source checkout; pass --data elsewhere)
DATA_DIR = Path(__file__).resolve().parent / "data"  # package data (setup.py): the committed prompts
DEFAULT_DATA = (str(DATA_DIR / "smollm2_ruler.jsonl.xz"), str(DATA_DIR / "smollm2_robust.jsonl.xz"))


@dataclass(frozen=True)
class Method:
    name: str
    cfg: dict  # ElasticConfig updates over the base config
    router: bool  # needs the trained router
    static: bool = False
    xa: bool = False
    label: str = ""


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("dense", {"force": "all-FA", "mode": "FA-SSA", "decode_mode": "dense"}, False, label="dense (all FA)"),
        Method("elastic", {"force": "auto", "mode": "FA-SSA", "decode_mode": "dense"}, True, label="Elastic FA-SSA"),
        Method(
            "static",
            {"force": "auto", "mode": "FA-SSA", "decode_mode": "dense"},
            False,
            static=True,
            label="static hybrid (retrieval-ranked)",
        ),
        Method(
            "all-SA", {"force": "all-SA", "mode": "FA-SSA", "decode_mode": "sparse"}, False, label="all SSA (streaming)"
        ),
        Method(
            "elastic-sparse",
            {"force": "auto", "mode": "FA-SSA", "decode_mode": "sparse"},
            True,
            label="Elastic FA-SSA, sparse decode",
        ),
        Method(
            "FA-XA", {"force": "auto", "mode": "FA-XA", "decode_mode": "dense"}, True, xa=True, label="Elastic FA-XA"
        ),
        Method(
            "XA-SSA", {"force": "auto", "mode": "XA-SSA", "decode_mode": "dense"}, True, xa=True, label="Elastic XA-SSA"
        ),
    )
}


# --- the engine -----------------------------------------------------------------------------------
def newline_tables(tokenizer, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token id: contains a newline; has non-blank text; has non-blank text before its first newline."""
    texts = tokenizer.batch_decode([[i] for i in range(min(len(tokenizer), vocab))])
    nl = torch.zeros(vocab, dtype=torch.bool)
    text = torch.zeros(vocab, dtype=torch.bool)
    text_nl = torch.zeros(vocab, dtype=torch.bool)
    for i, s in enumerate(texts):
        nl[i] = "\n" in s
        text[i] = bool(s.strip())
        text_nl[i] = "\n" in s and bool(s.split("\n", 1)[0].strip())
    return nl.to(device), text.to(device), text_nl.to(device)


def _first_line_stop(tables, prompt_len: int):
    """A stopping criterion: a row is done once it produced a newline after some non-blank text."""
    from transformers import StoppingCriteria

    nl, text, text_nl = tables

    class FirstLineStop(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
            gen = input_ids[:, prompt_len:]
            t = text[gen].long()
            had_text = (torch.cumsum(t, 1) - t) > 0  # non-blank text BEFORE token i
            return ((nl[gen] & had_text) | text_nl[gen]).any(1)

    return FirstLineStop()


class HFEngine:
    """One elastic transformers model; ``use(method)`` switches the configuration between runs."""

    def __init__(self, model_dir, base_cfg: ElasticConfig, router: str | None, dtype, device, impl: str):
        from elastic_vllm.hf import load_elastic_model

        self.model, self.tok = load_elastic_model(model_dir, base_cfg, router, dtype=dtype, device=device, impl=impl)
        self.state = self.model.elastic_state
        self.base_cfg = base_cfg
        self.device = torch.device(device)
        self.vocab = self.model.get_output_embeddings().weight.shape[0]
        eos = {self.tok.eos_token_id}
        gc_eos = self.model.generation_config.eos_token_id
        eos |= set(gc_eos if isinstance(gc_eos, list) else [gc_eos] if gc_eos is not None else [])
        self.eos = sorted(e for e in eos if e is not None)
        self.method: Method | None = None
        self._nl_tables: tuple | None = None

    def use(self, method: Method, static_routing: torch.Tensor | None = None) -> ElasticConfig:
        self.state.set_config(**{**self.base_cfg.model_dump(), **method.cfg})
        self.state.fixed_routing = static_routing.to(self.device) if method.static else None
        if method.router and self.state.router is None:
            raise ValueError(f"method {method.name} needs the trained router (--router)")
        self.method = method
        return self.state.cfg

    def _encode(self, texts: list[str]):
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)

    def _routing(self, lengths: list[int]) -> list[dict]:
        """Per row: FA decisions [L, H] (cpu), Omega_MSR, Omega_ESR at the row's real length."""
        cfg = self.state.cfg
        routing = self.state.last_routing.cpu()
        xa: dict[int, dict] = defaultdict(dict)
        for (b, layer, h), m in self.state.xa_masks.items():
            xa[b][(layer, h)] = m.cpu()
        out = []
        for b, n in enumerate(lengths):
            is_fa = routing[b]
            modes = torch.where(is_fa, int(cfg.fa_mode), int(cfg.sa_mode))
            out.append(
                {
                    "is_fa": is_fa,
                    "omega_msr": float((~is_fa).float().mean()),
                    "omega_esr": omega_esr(modes, n, cfg, xa.get(b)),
                }
            )
        return out

    @torch.no_grad()
    def generate(self, texts: list[str], max_new: int, first_line: bool = False) -> tuple[list[str], list[dict]]:
        from transformers import GenerationConfig, StoppingCriteriaList

        ids, mask = self._encode(texts)
        lengths = mask.sum(1).tolist()
        gc = GenerationConfig(
            max_new_tokens=max_new, do_sample=False, eos_token_id=self.eos, pad_token_id=self.tok.pad_token_id
        )
        stop = None
        if first_line:
            if self._nl_tables is None:
                self._nl_tables = newline_tables(self.tok, self.vocab, self.device)
            stop = StoppingCriteriaList([_first_line_stop(self._nl_tables, ids.shape[1])])
        out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gc, stopping_criteria=stop)
        routes = self._routing(lengths)
        gen = out[:, ids.shape[1] :]
        preds = self.tok.batch_decode(gen, skip_special_tokens=True)
        for r, g in zip(routes, gen.tolist()):
            r["new_tokens"] = sum(1 for t in g if t != self.tok.pad_token_id)
        return preds, routes

    @torch.no_grad()
    def nll_last(self, texts: list[str], n_last: int) -> tuple[list[float], list[dict]]:
        """Mean NLL (nats) of each text's last ``n_last`` tokens, one teacher-forced forward."""
        ids, mask = self._encode(texts)
        lengths = mask.sum(1).tolist()
        if min(lengths) <= n_last:
            raise ValueError(f"continuation texts must be longer than {n_last} tokens (got {min(lengths)})")
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=n_last + 1).logits
        pred = logits[:, :-1].float()
        tgt = ids[:, -n_last:]
        nll = torch.nn.functional.cross_entropy(pred.reshape(-1, pred.shape[-1]), tgt.reshape(-1), reduction="none")
        return nll.view(len(texts), n_last).mean(1).tolist(), self._routing(lengths)


# --- provenance -----------------------------------------------------------------------------------
def provenance(argv: list[str], device: torch.device) -> dict:
    """The run's record (``elastic_vllm.provenance``: command, commit, time) with the device and the versions the
    evaluation depends on."""
    import transformers

    from elastic_vllm.provenance import provenance as run_provenance

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (cpu)"
    return {
        **run_provenance(argv),
        "gpu": gpu,
        "device": str(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "host_cpu_count": os.cpu_count(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def base_config(
    router: str | None, sink: int | None, window: int | None, sa_margin: float | None = None
) -> tuple[ElasticConfig, dict]:
    """SSA/XA knobs from the router's checkpoint (attention + pooling blocks), else the demo defaults."""
    fields = set(ElasticConfig.model_fields)
    raw: dict[str, Any] = {"sink": 128, "window": 512}
    meta = {}
    if router:
        from elastic_vllm.router.checkpoint import read_meta

        m = read_meta(router)
        meta = {"backbone": m.backbone.model_dump(), "sha256": m.sha256, "attention": m.attention}
        raw.update({k: v for k, v in m.attention.items() if k in fields})
        if "mode" in m.pooling:
            raw["pooling"] = m.pooling["mode"]
        if "tokens" in m.pooling:
            raw["pool_tokens"] = m.pooling["tokens"]
    if sink is not None:
        raw["sink"] = sink
    if window is not None:
        raw["window"] = window
    if sa_margin is not None:
        raw["sa_margin"] = sa_margin
    raw.pop("router_path", None)
    return ElasticConfig.parse(raw), meta


def finite_mean(xs) -> float:
    """Mean of the values that are neither None nor NaN (NaN when none is)."""
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else float("nan")
