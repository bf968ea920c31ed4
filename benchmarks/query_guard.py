#!/usr/bin/env python3
"""A training-free, query-aware guard on top of the router: do the prompt's last queries tell which heads a
retrieval prompt cannot spare, and would keeping those heads FA fix the router's misses without costing the
robust prompts their sparsity?

    python3 benchmarks/query_guard.py --out benchmarks/results/query-guard-smollm2-cpu.json     # CPU, ~2 h

The demo model (SmolLM2-135M-Instruct, float32, the transformers engine) with the shipped router, sink 128, window
512. At the step that completes a prompt, every layer's last ``n_q`` prompt queries are scored against all keys
of the prompt, per KV head (mean or max over its query heads and the ``n_q`` queries):

    far      attention probability the queries put on keys SA drops (causal, not sink, not window)
    out      ||O_FA - O_SA|| / ||O_FA||: how much SA changes those queries' output
    peak     the largest single far-key probability (a copy head reads one place, a diffuse head many)

The guard: a head the router sends to SA stays FA when its signal exceeds a threshold. It is evaluated two ways:
``sim`` (the router pass's signals, thresholded offline, applied as a fixed routing: cheap, used for the sweep)
and ``inline`` (computed per layer during the prefill from that layer's own queries, after the guard acted on the
layers below it: what a server would run), for the settings picked from the sweep.

Prompts (seeded, deterministic; haystacks that the router's training mixture never used, see
elastic_vllm/train/DATA.md): Node.js API documentation (/usr/share/doc/nodejs/api, Debian's nodejs package),
Python source of torch.nn.modules (site-packages; the mixture uses the standard library only), Newton's Opticks
(Project Gutenberg text shipped with tvm_ffi's libbacktrace). Sensitive: a 6-digit value stated once, at depth
0.1 of the haystack or later and >= 612 tokens before its end (outside the last query's window), asked for after
it in RULER's form (the question, then an answer prefix after the generation prompt); scored found / not found in
up to 24 greedy tokens. Robust: ``cont`` (raw text, loss of its next 128 tokens) and ``summ`` (a summary
instruction; loss of the dense model's own 32-token greedy summary), both teacher-forced after a routed prefill of
the prompt (decode_mode dense: the tokens after the prompt read every key, as the server's default).

Retrieval reference per head: the committed static retrieval scores (``eval.baselines.retrieval_scores`` of the
shipped-router runs) and, per sensitive prompt, the needle mass of the queries that emitted the answer's tokens
under dense attention (prompts dense answers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from _harness import ROOT, environment, log, write_json

SINK, WINDOW = 128, 512
NQ_MAX = 64
SUMM_TOKENS = 32
NQS = (16, 32, 64)
DOCS_DIR = Path("/usr/share/doc/nodejs/api")
PROSE_FILE = "tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt"
CODE_PKG = "torch/nn/modules"
STATIC_SCORES = ROOT / "benchmarks" / "results" / "budgets-smollm2-h200" / "results.json"
ADJ = ("amber", "brisk", "cobalt", "dusty", "ember", "frosty", "golden", "hollow", "ivory", "jagged", "lunar", "misty")
NOUN = ("falcon", "harbor", "lantern", "meadow", "orchard", "quarry", "ribbon", "summit", "tunnel", "walnut")


# --- haystacks ---------------------------------------------------------------------------------------------
def site_packages() -> Path:
    import torch

    return Path(torch.__file__).resolve().parents[1]


def haystack_sources() -> dict[str, list[tuple[str, str]]]:
    """kind -> [(name, text)] in a fixed order; raises if a source is missing (no silent substitute)."""
    sp = site_packages()
    docs = sorted(DOCS_DIR.glob("*.md"))
    code = sorted((sp / CODE_PKG).glob("*.py"))
    prose = sp / PROSE_FILE
    if not docs:
        raise FileNotFoundError(f"{DOCS_DIR}/*.md: the Node.js API docs (Debian package nodejs-doc / nodejs)")
    if not code:
        raise FileNotFoundError(f"{sp / CODE_PKG}/*.py: torch's source files")
    if not prose.is_file():
        raise FileNotFoundError(f"{prose}: Newton's Opticks (shipped with the tvm_ffi package)")
    text = prose.read_text(errors="replace")
    # the Gutenberg header and licence are not the book
    a, b = text.find("SIR ISAAC NEWTON'S ADVERTISEMENTS"), text.find("End of the Project Gutenberg")
    return {
        "docs": [(f.name, f.read_text(errors="replace")) for f in docs if f.stat().st_size > 20_000],
        "code": [(f"{CODE_PKG}/{f.name}", f.read_text(errors="replace")) for f in code if f.stat().st_size > 20_000],
        "prose": [("Opticks", text[a : b if b > 0 else None])],
    }


def sources_digest(src: dict) -> dict:
    return {
        k: {"files": len(v), "sha256": hashlib.sha256("".join(n + t for n, t in v).encode()).hexdigest()}
        for k, v in src.items()
    }


def stretch(tok, rng: random.Random, docs: list[tuple[str, str]], n_tokens: int) -> tuple[str, str]:
    """``n_tokens`` consecutive tokens of one document (documents too short are joined with the next ones)."""
    i = rng.randrange(len(docs))
    name, text = docs[i]
    while True:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= n_tokens + 64:
            break
        i = (i + 1) % len(docs)
        text += "\n\n" + docs[i][1]
    start = rng.randrange(0, len(ids) - n_tokens)
    return name, tok.decode(ids[start : start + n_tokens])


def _cut_points(text: str, kind: str) -> list[int]:
    """Where a needle can go without breaking the haystack's grammar: after a sentence (prose, docs) or before a
    top-level statement (code)."""
    if kind == "code":
        return [m.start() for m in re.finditer(r"\n(?=(def |class |[A-Za-z_]\w* = ))", text)]
    return [m.end() for m in re.finditer(r"[.!?](?=\s)|(?<=\S)(?=\n\n)", text)]


@dataclass
class Prompt:
    pid: str
    family: str  # docs_number | code_value | prose_number | cont | summ
    category: str  # sensitive | robust
    haystack: str
    text: str  # what is tokenized (chat template applied where the family has one)
    answer: str = ""  # sensitive: the value
    needle_span: tuple[int, int] = (0, 0)  # sensitive: the value's characters in ``text``
    target: str = ""  # cont: the true next text
    source: str = ""
    extra: dict = field(default_factory=dict)


def _chat(tok, content: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)


def interleaved(prompts: list[Prompt]) -> list[Prompt]:
    """The prompts family by family in turn (a run cut short still covers every family)."""
    fams: dict[str, list[Prompt]] = {}
    for p in prompts:
        fams.setdefault(p.family, []).append(p)
    out = []
    for i in range(max(len(v) for v in fams.values())):
        out += [v[i] for v in fams.values() if i < len(v)]
    return out


def build_prompts(tok, src, per_family: int, n_cont: int, n_summ: int, hay_tokens: int, seed: int) -> list[Prompt]:
    out: list[Prompt] = []
    sens = (
        ("docs_number", "docs", "the Node.js documentation"),
        ("code_value", "code", "the Python code"),
        ("prose_number", "prose", "the text"),
    )
    # the needle stays out of the last query's window with ~100 tokens to spare (the question and the template)
    deepest = (hay_tokens - WINDOW - 100) / hay_tokens
    if deepest <= 0.2:
        raise ValueError(f"--tokens {hay_tokens}: too short to put a needle outside the {WINDOW}-token window")
    for fam, kind, what in sens:
        rng = random.Random(f"{seed}-{fam}")
        for i in range(per_family):
            for _ in range(20):  # a stretch of API listings may have no sentence end: draw another
                name, hay = stretch(tok, rng, src[kind], hay_tokens)
                cuts = [c for c in _cut_points(hay, kind) if 0.1 <= c / len(hay) <= deepest]
                if cuts:
                    break
            else:
                raise RuntimeError(f"{fam} {i}: no place for the needle in 20 stretches of {kind}")
            value = str(rng.randrange(100_000, 1_000_000))
            adj, noun = rng.choice(ADJ), rng.choice(NOUN)
            at = rng.choice(cuts)
            # RULER's form (eval/needle.py): the question, then an answer prefix after the generation prompt; without
            # the prefix the 135M demo model answered 0 of 2 such prompts densely (it lists or guesses instead)
            if kind == "code":
                ident = f"{adj.upper()}_{noun.upper()}_TOKEN"
                needle = f"\n{ident} = {value}\n"
                question = f"What value is assigned to {ident} in the code above?"
                prefix = f"The value assigned to {ident} is"
            elif kind == "docs":
                needle = f" The access code of the {adj} {noun} service is {value}."
                question = f"What is the access code of the {adj} {noun} service mentioned in the documentation above?"
                prefix = f"The access code of the {adj} {noun} service is"
            else:
                needle = f" The secret number of the {adj} {noun} is {value}."
                question = f"What is the secret number of the {adj} {noun} mentioned in the text above?"
                prefix = f"The secret number of the {adj} {noun} is"
            body = hay[:at] + needle + hay[at:]
            content = f"Read {what} below and answer the question after it.\n\n{body}\n\n{question}"
            text = _chat(tok, content) + prefix
            a = text.find(needle) + needle.find(value)
            out.append(Prompt(f"{fam}-{i}", fam, "sensitive", kind, text, value, (a, a + len(value)), source=name))
    kinds = ("docs", "code", "prose")
    rng = random.Random(f"{seed}-cont")
    for i in range(n_cont):
        kind = kinds[i % 3]
        name, hay = stretch(tok, rng, src[kind], hay_tokens + 128)
        ids = tok(hay, add_special_tokens=False)["input_ids"]
        out.append(
            Prompt(
                f"cont-{i}", "cont", "robust", kind, tok.decode(ids[:-128]), target=tok.decode(ids[-128:]), source=name
            )
        )
    rng = random.Random(f"{seed}-summ")
    for i in range(n_summ):
        kind = kinds[i % 3]
        name, hay = stretch(tok, rng, src[kind], hay_tokens)
        content = f"Read the following text.\n\n{hay}\n\nNow summarize the text above in a few sentences."
        out.append(Prompt(f"summ-{i}", "summ", "robust", kind, _chat(tok, content), source=name))
    return out


# --- signals: recorded at every prefill, and the guard acting inside it ---------------------------------------
class Recorder:
    """Per prefill: the raw per-query signals of every layer; at decode steps: the needle mass (dense pass)."""

    def __init__(self):
        self.reset()
        self.guard: tuple | None = None  # (signal name, n_q, threshold) of the inline guard, or None
        self.switch: tuple | None = None  # (signal name, n_q, threshold, bias) of the inline switch, or None

    def reset(self, needle=None):
        self.layers: dict[int, dict] = {}  # layer -> {"far", "out", "peak"}: [Hq, NQ_MAX] float32
        self.needle = needle  # bool [P] needle tokens, or None
        self.needle_mass: dict[int, list] = {}  # layer -> [[Hq] per answer query]
        self.pending: dict | None = None
        self.switched: int | None = None  # the layer where the switch fired in this prefill


REC = Recorder()


def first_switch_layer_ok(sig, is_fa, thr: float):
    """Does this layer fire the switch: some head the router sends to SA has a signal above ``thr``?"""
    return (sig.to(is_fa.device)[~is_fa] > thr).any()


def switch_layer(router_res: dict, name: str, n_q: int, thr: float) -> int | None:
    """The first layer where the switch fires, from the router pass: exact for the inline switch too (below that
    layer its prefill is the router pass, so that layer sees the router pass's queries)."""
    for layer in sorted(router_res["signals"]):
        sig = head_signal(router_res["signals"][layer], name, n_q)
        if bool(first_switch_layer_ok(sig, router_res["routing"][layer], thr)):
            return layer
    return None


def per_query_signals(q, k, v, scale: float):
    """q [1, Hq, T, D] post-RoPE, k / v [1, Hkv, T, D] -> far mass, output change, far peak, each [Hq, nq] float32,
    for the last nq = min(NQ_MAX, T) queries; plus the full probabilities of the last query [Hq, T]."""
    import torch

    T = q.shape[2]
    G = q.shape[1] // k.shape[1]
    nq = min(NQ_MAX, T)
    qs = q[0, :, T - nq :].float()
    kk = k[0].float().repeat_interleave(G, 0)
    vv = v[0].float().repeat_interleave(G, 0)
    s = torch.einsum("hqd,hkd->hqk", qs, kk) * scale
    i = torch.arange(T - nq, T, device=q.device)[:, None]
    j = torch.arange(T, device=q.device)[None]
    causal = j <= i
    sa = causal & ((j < SINK) | (i - j < WINDOW))
    far = causal & ~sa
    p = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
    p_sa = torch.softmax(s.masked_fill(~sa, float("-inf")), -1)
    o_fa, o_sa = p @ vv, p_sa @ vv
    pf = p * far
    return {
        "far": pf.sum(-1),
        "out": (o_fa - o_sa).norm(dim=-1) / o_fa.norm(dim=-1).clamp(min=1e-12),
        "peak": pf.amax(-1),
    }, p[:, -1]


def head_signal(raw: dict, name: str, n_q: int):
    """[Hq, NQ_MAX] per-query signals of one layer -> [Hkv] per KV head. ``name`` = signal _ query-reduction, e.g.
    far_mean (mean over the group's query heads and the last n_q queries), far_max (max over both)."""
    sig, red = name.split("_")
    x = raw[sig][:, -n_q:]
    x = x.reshape(HKV, -1, x.shape[-1])
    return x.mean((1, 2)) if red == "mean" else x.amax((1, 2))


HKV = 3  # KV heads of the model (set from its config in main)
SIGNALS = ("far_mean", "far_max", "out_mean", "out_max", "peak_max")


def install(model):
    """Wrap the ``elastic`` attention function (signals + inline guard) and the prefill routing (the guard)."""
    import torch
    from transformers import AttentionInterface

    from elastic_vllm.hf import attention as hfatt
    from elastic_vllm.router.model import decide, effective_margin

    orig_forward = hfatt.elastic_attention_forward
    orig_route = hfatt._route

    def forward(module, query, key, value, attention_mask, **kw):
        scale = kw.get("scaling") or query.shape[-1] ** -0.5
        layer = int(module.layer_idx)
        if query.shape[2] == key.shape[2]:
            with torch.no_grad():
                raw, p_last = per_query_signals(query, key, value, scale)
            REC.layers[layer] = raw
            REC.pending = raw
            if REC.needle is not None:
                REC.needle_mass.setdefault(layer, []).append((p_last * REC.needle.float()).sum(-1))
        elif REC.needle is not None and query.shape[2] == 1:
            G = query.shape[1] // key.shape[1]
            s = torch.einsum("hd,hkd->hk", query[0, :, 0].float(), key[0].float().repeat_interleave(G, 0)) * scale
            p = torch.softmax(s, -1)
            n = REC.needle.shape[0]
            REC.needle_mass.setdefault(layer, []).append((p[:, :n] * REC.needle.float()).sum(-1))
        return orig_forward(module, query, key, value, attention_mask, **kw)

    def route(state, module, layer, k_pos, k_valid, B):
        is_fa, r = orig_route(state, module, layer, k_pos, k_valid, B)
        if REC.switch is not None and state.cfg.force == "auto":
            name, n_q, thr, bias = REC.switch
            if REC.switched is None and bool(first_switch_layer_ok(head_signal(REC.pending, name, n_q), is_fa[0], thr)):
                REC.switched = layer
            if REC.switched is not None:  # this layer and every later one: the request's retrieval bias
                is_fa = decide(state.logits[:, layer], effective_margin(state.cfg.sa_margin, bias))
                state.routing[:, layer] = is_fa
        if REC.guard is not None and state.cfg.force == "auto":
            name, n_q, thr = REC.guard
            keep = head_signal(REC.pending, name, n_q) > thr
            is_fa = is_fa | keep[None].to(is_fa.device)  # the router's SA heads that the prompt's queries need
            state.routing[:, layer] = is_fa
        return is_fa, r

    hfatt._route = route
    AttentionInterface.register(hfatt.ATTN_IMPLEMENTATION, forward)


# --- running one prompt ----------------------------------------------------------------------------------------
class _NumberStop:
    """Stop a greedy answer once it holds a whole number of 6+ digits (the found check needs no more: CPU time goes
    to the prompts, not to the model's closing sentence)."""

    def __init__(self, tok, prompt_len: int):
        self.tok, self.n = tok, prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        text = self.tok.decode(input_ids[0, self.n :], skip_special_tokens=True)
        done = bool(re.search(r"\d{6}\D", text))
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool)


class Runner:
    def __init__(self, model, tok, cache_dir: Path | None):
        self.model, self.tok = model, tok
        self.device = next(model.parameters()).device
        self.state = model.elastic_state
        self.cache_dir = cache_dir
        self.ran = 0
        self.cached = 0
        self.summ_targets: dict[str, str] = {}

    def _key(self, p: Prompt, spec: tuple, routing_bytes: bytes | None) -> str:
        h = hashlib.sha256(p.text.encode() + p.target.encode() + repr(spec).encode())
        h.update(self.summ_targets.get(p.pid, "").encode())
        if routing_bytes is not None:
            h.update(routing_bytes)
        return h.hexdigest()[:32]

    def run(self, p: Prompt, spec: tuple, record: bool = False) -> dict:
        """spec: ("dense",) | ("router",) | ("fixed", bool [L, H]) | ("inline", signal, n_q, threshold)."""
        import torch

        rb = spec[1].numpy().tobytes() if spec[0] == "fixed" else None
        key = self._key(p, spec if spec[0] != "fixed" else ("fixed",), rb)
        f = self.cache_dir / f"{key}.pt" if self.cache_dir else None
        if f is not None and f.is_file():
            self.cached += 1
            res = torch.load(f, weights_only=False)
            if "summ_target" in res:
                self.summ_targets[p.pid] = res["summ_target"]
            return res
        self.state.set_config(force="all-FA" if spec[0] == "dense" else "auto")
        self.state.fixed_routing = spec[1].to(self.device) if spec[0] == "fixed" else None
        REC.guard = tuple(spec[1:]) if spec[0] == "inline" else None
        REC.switch = tuple(spec[1:]) if spec[0] == "switch" else None
        enc = self.tok(p.text, add_special_tokens=False, return_offsets_mapping=True)
        ids = torch.tensor([enc["input_ids"]], device=self.device)
        needle = None
        if spec[0] == "dense" and p.category == "sensitive":
            a, b = p.needle_span
            needle = torch.tensor([s < b and e > a for s, e in enc["offset_mapping"]], device=self.device)
            if not bool(needle.any()):
                raise RuntimeError(f"{p.pid}: the needle maps to no token")
        REC.reset(needle)
        res: dict = {"pid": p.pid, "prompt_tokens": ids.shape[1]}
        with torch.no_grad():
            if p.category == "sensitive":
                out = self.model.generate(
                    ids,
                    max_new_tokens=24,
                    do_sample=False,
                    pad_token_id=self.tok.eos_token_id,
                    stopping_criteria=[_NumberStop(self.tok, ids.shape[1])],
                )
                gen = out[0, ids.shape[1] :].tolist()
                text = self.tok.decode(gen, skip_special_tokens=True)
                res["generated"] = text
                res["found"] = p.answer in text
                if needle is not None and res["found"]:
                    # the queries that produced the answer's tokens: step t (0 = the last prompt token) emits gen[t]
                    ends = [len(self.tok.decode(gen[: t + 1], skip_special_tokens=True)) for t in range(len(gen))]
                    a = text.find(p.answer)
                    steps = [t for t in range(len(gen)) if ends[t] > a and (t == 0 or ends[t - 1] < a + len(p.answer))]
                    res["needle_mass"] = torch.stack(
                        [
                            torch.stack([REC.needle_mass[layer][t] for t in steps]).mean(0).cpu()
                            for layer in sorted(REC.needle_mass)
                        ]
                    )  # [L, Hq]
            else:
                if p.family == "summ" and p.pid not in self.summ_targets:
                    if spec[0] != "dense":
                        raise RuntimeError("the dense pass writes the summary targets first")
                    out = self.model.generate(
                        ids, max_new_tokens=SUMM_TOKENS, do_sample=False, pad_token_id=self.tok.eos_token_id
                    )
                    self.summ_targets[p.pid] = res["summ_target"] = self.tok.decode(out[0, ids.shape[1] :])
                    REC.reset(None)
                target = p.target if p.family == "cont" else self.summ_targets[p.pid]
                tgt = torch.tensor([self.tok(target, add_special_tokens=False)["input_ids"]], device=self.device)
                o1 = self.model(ids, use_cache=True, logits_to_keep=1)
                o2 = self.model(tgt[:, :-1], past_key_values=o1.past_key_values)
                logits = torch.cat([o1.logits[:, -1:], o2.logits], 1).float()
                res["nll"] = float(torch.nn.functional.cross_entropy(logits[0], tgt[0]))
                res["target_tokens"] = tgt.shape[1]
        res["routing"] = self.state.routing[0].cpu()
        res["switch_layer"] = REC.switched
        res["omega"] = float(self.state.omega_msr()[0])
        if record:
            res["signals"] = {layer: {k: v.cpu() for k, v in r.items()} for layer, r in sorted(REC.layers.items())}
        self.ran += 1
        if f is not None:  # written whole or not at all: a run cut short leaves no half file to reuse
            torch.save(res, f.with_suffix(".tmp"))
            f.with_suffix(".tmp").replace(f)
        return res


# --- analysis ----------------------------------------------------------------------------------------------------
def kv_signal(res: dict, name: str, n_q: int):
    import torch

    return torch.stack([head_signal(res["signals"][layer], name, n_q) for layer in sorted(res["signals"])])


def auc(pos, neg) -> float:
    """P(signal of a positive head > signal of a negative head), ties count half."""

    pos, neg = pos.flatten()[:, None].double(), neg.flatten()[None].double()
    if pos.numel() == 0 or neg.numel() == 0:
        return float("nan")
    return float(((pos > neg).double() + 0.5 * (pos == neg).double()).mean())


def separation(prompts, dense, router, static_scores, top: int = 9) -> dict:
    """Per signal and n_q: head level, AUC of the signal (router pass) for the top-``top`` heads by the prompt's own
    dense needle mass and by the committed static scores, over sensitive prompts; prompt level, the mean and the
    quantiles of the signal on sensitive vs robust prompts among the heads the router sends to SA."""
    import torch

    out: dict = {}
    static_top = torch.zeros(static_scores.numel(), dtype=torch.bool)
    static_top[static_scores.flatten().argsort(descending=True)[:top]] = True
    static_top = static_top.view_as(static_scores)
    for name in SIGNALS:
        for n_q in NQS:
            a_oracle, a_static, a_oracle_dense = [], [], []
            sa_vals = {"sensitive": [], "robust": []}
            for p in prompts:
                r = router[p.pid]
                sig = kv_signal(r, name, n_q)
                sa = ~r["routing"]
                sa_vals[p.category].append(sig[sa])
                if "needle_mass" not in dense[p.pid]:  # robust, or dense did not find the answer
                    continue
                nm = dense[p.pid]["needle_mass"]  # [L, Hq]
                nm_kv = nm.view(nm.shape[0], -1, nm.shape[1] // sig.shape[1]).mean(-1)
                o_top = torch.zeros(nm_kv.numel(), dtype=torch.bool)
                o_top[nm_kv.flatten().argsort(descending=True)[:top]] = True
                o_top = o_top.view_as(nm_kv)
                a_oracle.append(auc(sig[o_top], sig[~o_top]))
                a_static.append(auc(sig[static_top], sig[~static_top]))
                sd = kv_signal(dense[p.pid], name, n_q)
                a_oracle_dense.append(auc(sd[o_top], sd[~o_top]))
            s_all = torch.cat(sa_vals["sensitive"])
            r_all = torch.cat(sa_vals["robust"])
            qs = torch.tensor([0.5, 0.9, 0.99])
            out[f"{name}@{n_q}"] = {
                "auc_vs_prompt_needle_top9": sum(a_oracle) / len(a_oracle),
                "auc_vs_prompt_needle_top9_dense_signal": sum(a_oracle_dense) / len(a_oracle_dense),
                "auc_vs_static_top9": sum(a_static) / len(a_static),
                "router_sa_heads_sensitive_q50_q90_q99": torch.quantile(s_all.double(), qs.double()).tolist(),
                "router_sa_heads_robust_q50_q90_q99": torch.quantile(r_all.double(), qs.double()).tolist(),
                # does the signal tell a sensitive prompt's SA heads from a robust prompt's? (prompt-level AUC of
                # the per-prompt maximum over SA heads)
                "prompt_auc_max_over_sa": auc(
                    torch.stack([v.max() for v in sa_vals["sensitive"]]),
                    torch.stack([v.max() for v in sa_vals["robust"]]),
                ),
                # the margin behind that AUC: the lowest sensitive and the highest robust per-prompt maximum
                "prompt_max_over_sa_min_sensitive": min(float(v.max()) for v in sa_vals["sensitive"]),
                "prompt_max_over_sa_max_robust": max(float(v.max()) for v in sa_vals["robust"]),
            }
    return out


def guarded(router_res: dict, name: str, n_q: int, thr: float):
    return router_res["routing"] | (kv_signal(router_res, name, n_q) > thr)


def sim_guard(run: Runner, p: Prompt, router_res: dict, name: str, n_q: int, thr: float) -> dict:
    """The guard applied to the router pass's signals (``fixed_or_omega``)."""
    return fixed_or_omega(run, p, router_res, guarded(router_res, name, n_q, thr))


def fixed_or_omega(run: Runner, p: Prompt, router_res: dict, fa) -> dict:
    """Sensitive prompts run under the routing ``fa`` (the router's own result when it adds no head to the
    router's); robust prompts only get its Omega_MSR (their loss is measured by the inline runs: keeping heads FA
    moves a robust prompt toward dense, what it costs is sparsity)."""
    if p.category == "robust":
        return {"pid": p.pid, "omega": float((~fa).float().mean()), "nll": None, "routing": fa}
    if bool((fa == router_res["routing"]).all()):
        return router_res
    return run.run(p, ("fixed", fa))


def oracle_guard(run: Runner, p: Prompt, dense_res: dict, router_res: dict, k: int) -> dict:
    """Router + the prompt's own top-k KV heads by dense needle mass FA: sensitive prompts the dense model answers
    (the needle mass is measured on its answer); other prompts keep the router's result."""
    import torch

    nm = dense_res.get("needle_mass")
    if nm is None:
        return router_res
    kv = nm.view(nm.shape[0], HKV, -1).mean(-1).flatten()
    top = torch.zeros(kv.shape, dtype=torch.bool)
    top[kv.argsort(descending=True)[:k]] = True
    fa = router_res["routing"] | top.view_as(router_res["routing"])
    if bool((fa == router_res["routing"]).all()):
        return router_res
    return run.run(p, ("fixed", fa))


def switch_guard(run: Runner, p: Prompt, router_res: dict, spec: tuple) -> dict:
    """The request-level switch: from the first layer where a head the router sends to SA has a signal above the
    threshold, that layer and every later one route with the retrieval bias. A prompt where it never fires is the
    router pass (its result, without a run)."""
    if switch_layer(router_res, *spec[1:4]) is None:
        return router_res
    res = run.run(p, spec)
    if res["switch_layer"] != switch_layer(router_res, *spec[1:4]):
        raise RuntimeError(
            f"{p.pid}: the inline switch fired at layer {res['switch_layer']}, the router pass says "
            f"{switch_layer(router_res, *spec[1:4])}"
        )
    return res


def inline_guard(run: Runner, p: Prompt, router_res: dict, name: str, n_q: int, thr: float) -> dict:
    """The guard inside the prefill. Where it keeps no head of the router pass, the inline run is the router pass
    (layer 0 sees the same queries, keeps nothing, so layer 1 does too, and so on): its result, without a run."""
    if bool((guarded(router_res, name, n_q, thr) == router_res["routing"]).all()):
        return router_res
    return run.run(p, ("inline", name, n_q, thr))


GRID = {"far": (0.1, 0.2, 0.3, 0.5, 0.7, 0.9), "out": (0.2, 0.3, 0.5, 0.7, 0.9), "peak": (0.1, 0.2, 0.3, 0.5, 0.7, 0.9)}


def omega_grid(prompts, router: dict) -> dict:
    """Omega_MSR of router + guard (router-pass signals) per category on a threshold grid: the sparsity side of the
    sweep, for every signal, with no model run."""
    out = {}
    for name in SIGNALS:
        for n_q in NQS:
            rows = {}
            for thr in GRID[name.split("_")[0]]:
                om: dict = {"sensitive": [], "robust": []}
                for p in prompts:
                    om[p.category].append(float((~guarded(router[p.pid], name, n_q, thr)).float().mean()))
                rows[f"{thr:g}"] = {c: sum(v) / len(v) for c, v in om.items() if v}
            out[f"{name}@{n_q}"] = rows
    return out


def summarize(prompts, results: dict) -> dict:
    """Per family and category: found-rate (sensitive), mean nll (robust), mean Omega_MSR."""
    fams: dict = {}
    for p in prompts:
        r = results[p.pid]
        d = fams.setdefault(p.family, {"category": p.category, "n": 0, "omega": 0.0, "found": 0, "nll": 0.0})
        d["n"] += 1
        d["omega"] += r["omega"]
        if p.category == "sensitive":
            d["found"] += int(r["found"])
        elif d["nll"] is not None:
            d["nll"] = None if r["nll"] is None else d["nll"] + r["nll"]
    for d in fams.values():
        d["omega"] /= d["n"]
        if d["category"] == "sensitive":
            d["found_rate"] = d.pop("found") / d["n"]
            d.pop("nll")
        else:
            d["nll"] = None if d["nll"] is None else d["nll"] / d["n"]
            d.pop("found")
    cats: dict = {}
    for c in ("sensitive", "robust"):
        ps = [p for p in prompts if p.category == c]
        cats[c] = {"n": len(ps), "omega": sum(results[p.pid]["omega"] for p in ps) / len(ps)}
        if c == "sensitive":
            cats[c]["found_rate"] = sum(results[p.pid]["found"] for p in ps) / len(ps)
        else:
            nll = [results[p.pid]["nll"] for p in ps]
            cats[c]["nll"] = None if None in nll else sum(nll) / len(ps)
    return {"families": fams, "categories": cats}


def static_omega(summary: dict, p: Prompt, mode: str) -> float:
    if mode == "family":
        return summary["families"][p.family]["omega"]
    cats = summary["categories"]
    return sum(c["omega"] * c["n"] for c in cats.values()) / sum(c["n"] for c in cats.values())


def per_prompt(prompts, results: dict) -> list[dict]:
    rows = []
    for p in prompts:
        r = results[p.pid]
        row = {"pid": p.pid, "omega": round(r["omega"], 4)}
        if "found" in r:
            row.update(found=r["found"], generated=r["generated"])
        elif r["nll"] is not None:
            row["nll"] = round(r["nll"], 4)
        if r.get("switch_layer") is not None:  # where a request-level switch fired
            row["switch_layer"] = r["switch_layer"]
        rows.append(row)
    return rows


def render_md(payload: dict) -> str:
    """The result as Markdown: per method, found-rate / loss and Omega_MSR per family and per category."""
    fams = list(payload["methods"]["dense"]["families"])
    head = ["method", *fams, "sensitive", "robust"]
    lines = [
        f"Query guard, {payload['model'].rsplit('/', 1)[-1]}, router {payload['router'].rsplit('/', 1)[-1]}, "
        f"commit {payload['env']['git_commit'][:10]}: found-rate (sensitive) or loss in nats (robust) / Omega_MSR",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]

    def cell(d: dict) -> str:
        v = d.get("found_rate")
        if v is None:
            v = d.get("nll")
            val = "-" if v is None else f"{v:.3f}"
        else:
            val = f"{100 * v:.0f}%"
        return f"{val} / {d['omega']:.2f}"

    for m, r in payload["methods"].items():
        row = [m] + [cell(r["families"][f]) for f in fams] + [cell(r["categories"][c]) for c in ("sensitive", "robust")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: elastic-vllm fetch-model's demo model)")
    ap.add_argument("--router", default=str(ROOT / "router_weights" / "smollm2-135m-instruct"))
    ap.add_argument("--per-family", type=int, default=10, help="prompts per sensitive family")
    ap.add_argument("--cont", type=int, default=9, help="continuation prompts (docs, code, prose in turn)")
    ap.add_argument("--summ", type=int, default=6, help="summary prompts (docs, code, prose in turn)")
    ap.add_argument("--tokens", type=int, default=1000, help="haystack tokens per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--sweep",
        nargs="*",
        default=[],
        help="guard settings evaluated with the router pass's signals (sim): SIGNAL:N_Q:THR,THR,...",
    )
    ap.add_argument(
        "--switch",
        nargs="*",
        default=[],
        help="SIGNAL:N_Q:THR:BIAS: from the first layer where a router-SA head's signal exceeds THR, route with BIAS",
    )
    ap.add_argument("--inline", nargs="*", default=[], help="guard settings run inline: SIGNAL:N_Q:THR")
    ap.add_argument("--oracle", nargs="*", type=int, default=[], help="router + the prompt's top-K needle-mass heads")
    ap.add_argument(
        "--floor", nargs="*", default=[], help="K:THR: router + the static top-K heads, alone and with the peak guard"
    )
    ap.add_argument(
        "--static",
        nargs="*",
        default=[],
        choices=("mean", "family"),
        help="the static ranking at each inline guard's / switch's Omega_MSR: its mean over all prompts, per family",
    )
    ap.add_argument("--cache", default=None, help="folder for per-prompt results (a rerun reuses them)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (float32 either way)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--fa-floor",
        type=lambda v: float(v) if "." in v else int(v),
        default=None,
        help="the router's fail-safe floor (ElasticConfig.fa_floor: a count, a share in (0, 1), 0 for off; default: the config's)",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    from elastic_vllm.eval.baselines import static_routing
    from elastic_vllm.hf import load_elastic_model
    from elastic_vllm.hf.integration import config_of_router

    global HKV
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model
    if model_dir is None:
        from elastic_vllm.models import fetch_demo_model

        model_dir = str(fetch_demo_model(quiet=True))
    base = config_of_router(args.router)
    if args.fa_floor is not None:
        base = type(base).parse({**base.model_dump(), "fa_floor": args.fa_floor})
    model, tok = load_elastic_model(model_dir, base, args.router, device=args.device)
    cfg = model.elastic_state.cfg
    if (cfg.sink, cfg.window, cfg.mode) != (SINK, WINDOW, "FA-SSA"):
        raise ValueError(f"this measurement is for FA-SSA sink {SINK} window {WINDOW}; the router has {cfg}")
    HKV = model.elastic_state.num_kv_heads
    install(model)
    src = haystack_sources()
    prompts = build_prompts(tok, src, args.per_family, args.cont, args.summ, args.tokens, args.seed)
    log(f"{len(prompts)} prompts, {sum(p.category == 'sensitive' for p in prompts)} sensitive")
    cache = Path(args.cache) if args.cache else None
    if cache:
        cache.mkdir(parents=True, exist_ok=True)
    run = Runner(model, tok, cache)
    st = json.loads(STATIC_SCORES.read_text())
    static_scores = torch.tensor(st["retrieval_scores"])
    t0 = time.time()
    dense, router = {}, {}
    for n, p in enumerate(interleaved(prompts)):
        dense[p.pid] = run.run(p, ("dense",), record=True)
        router[p.pid] = run.run(p, ("router",), record=True)
        log(
            f"{n + 1}/{len(prompts)} {p.pid}: dense {dense[p.pid].get('found', dense[p.pid].get('nll'))} "
            f"router {router[p.pid].get('found', router[p.pid].get('nll'))} omega {router[p.pid]['omega']:.2f} "
            f"(ran {run.ran}, cached {run.cached})"
        )
    methods = {"dense": dense, "router": router}
    sep = separation(prompts, dense, router, static_scores)
    sweep = []
    for item in args.sweep:
        name, n_q, thrs = item.split(":")
        for thr in map(float, thrs.split(",")):
            label = f"sim {name}@{n_q}>{thr:g}"
            methods[label] = {p.pid: sim_guard(run, p, router[p.pid], name, int(n_q), thr) for p in prompts}
            log(f"{label}: {summarize(prompts, methods[label])['categories']} (ran {run.ran}, cached {run.cached})")
    for k in args.oracle:
        # an upper bound for any guard that keeps k heads: the prompt's own top-k heads by dense needle mass
        label = f"router + top-{k} heads by the prompt's dense needle mass"
        methods[label] = {p.pid: oracle_guard(run, p, dense[p.pid], router[p.pid], k) for p in prompts}
        log(f"{label}: {summarize(prompts, methods[label])['categories']} (ran {run.ran}, cached {run.cached})")
    for item in args.switch:
        name, n_q, thr, bias = item.split(":")
        label = f"switch {name}@{n_q}>{float(thr):g} -> bias {float(bias):g}"
        spec = ("switch", name, int(n_q), float(thr), float(bias))
        methods[label] = {p.pid: switch_guard(run, p, router[p.pid], spec) for p in prompts}
        sweep.append(label)
        log(f"{label}: {summarize(prompts, methods[label])['categories']} (ran {run.ran}, cached {run.cached})")
    for item in args.inline:
        name, n_q, thr = item.split(":")
        label = f"inline {name}@{n_q}>{float(thr):g}"
        methods[label] = {p.pid: inline_guard(run, p, router[p.pid], name, int(n_q), float(thr)) for p in prompts}
        sweep.append(label)
        log(f"{label}: {summarize(prompts, methods[label])['categories']} (ran {run.ran}, cached {run.cached})")
    # the static ranking (the same heads SA for every prompt) at the mean Omega_MSR each inline guard / switch
    # realized over all prompts; "family": at its Omega on each family (a static hybrid told the task family)
    for label in sweep:
        for mode in args.static:
            summ = summarize(prompts, methods[label])
            slabel = f"static @ {'per-family' if mode == 'family' else 'mean'} omega of {label}"
            methods[slabel] = {
                p.pid: run.run(p, ("fixed", static_routing(static_scores, static_omega(summ, p, mode))))
                for p in prompts
            }
            log(f"{slabel}: {summarize(prompts, methods[slabel])['categories']} (ran {run.ran}, cached {run.cached})")
    for item in args.floor:
        # the static floor (the top-K heads of the committed ranking always FA) alone and with the guard on top
        k, thr = item.split(":")
        floor = static_routing(static_scores, 1 - int(k) / static_scores.numel())
        label = f"router + static top-{k}"
        methods[label] = {
            p.pid: fixed_or_omega(run, p, router[p.pid], router[p.pid]["routing"] | floor) for p in prompts
        }
        log(f"{label}: {summarize(prompts, methods[label])['categories']} (ran {run.ran}, cached {run.cached})")
        label = f"router + static top-{k} + sim peak_max@64>{float(thr):g}"
        methods[label] = {
            p.pid: fixed_or_omega(run, p, router[p.pid], guarded(router[p.pid], "peak_max", 64, float(thr)) | floor)
            for p in prompts
        }
        log(f"{label}: {summarize(prompts, methods[label])['categories']} (ran {run.ran}, cached {run.cached})")
    payload = {
        "kind": "elastic-vllm query guard",
        "env": environment(("torch", "transformers")),
        "model": model_dir,
        "router": args.router,
        "config": {
            "sink": SINK,
            "window": WINDOW,
            "mode": "FA-SSA",
            "decode_mode": cfg.decode_mode,
            "fa_floor_heads": int(model.elastic_state.floor.sum()) if model.elastic_state.floor is not None else 0,
        },
        "static_scores": str(STATIC_SCORES.relative_to(ROOT)),
        "sources": sources_digest(src),
        "prompts": {
            "per_family": args.per_family,
            "cont": args.cont,
            "summ": args.summ,
            "tokens": args.tokens,
            "seed": args.seed,
            "sha256": hashlib.sha256("".join(p.text + p.target for p in prompts).encode()).hexdigest(),
            "mean_prompt_tokens": sum(router[p.pid]["prompt_tokens"] for p in prompts) / len(prompts),
        },
        "separation": sep,
        "omega_grid": omega_grid(prompts, router),
        "methods": {m: summarize(prompts, r) for m, r in methods.items()},
        "per_prompt": {m: per_prompt(prompts, r) for m, r in methods.items()},
        "forwards_run": run.ran,
        "wall_s": round(time.time() - t0, 1),
    }
    write_json(args.out, payload)
    Path(args.out).with_suffix(".md").write_text(render_md(payload))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
