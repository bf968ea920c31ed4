"""The generalization suite through the serving path: held-out families, per family, dense vs Elastic vs the
static ranking at the same Omega_MSR (and any other server configuration), over vLLM's OpenAI API.

Why one file of ~900 lines: one run (servers, samples, resume by configuration), its aggregation, targets and
report read the same sample rows; split, each part would re-describe the row.

    elastic-vllm eval --suite generalization --out OUT [--per-cell 20] [--variants dense elastic static]
        [--variant 'NAME={"fa_floor": 0}'] [--slice 'number/*'] [--resume]

Prompts: ``eval/heldout.py`` (14 sensitive retrieval cells; 12 robust families: a continuation and a summary of
each of the 6 haystacks). Each variant is a
server configuration (``--additional-config '{"elastic": {...}}'`` over the demo settings sink 128, window 512)
plus per-request ``vllm_xargs``, each variant on a fresh ``elastic-vllm serve`` (no state carried between them):

| variant | server | request |
|---|---|---|
| dense | the default configuration, the shipped router | ``elastic_force: all-FA`` |
| elastic | the default configuration (with the default fail-safe floor), the shipped router | nothing |
| NAME (``--variant NAME=JSON``) | the default configuration updated with JSON | nothing |
| static | a router whose margin z_FA - z_SA is each head's rank by static retrieval score | ``elastic_bias`` |

The static ranking: KV heads ranked once by retrieval score (``baselines.retrieval_scores``: attention mass on the
answer under dense attention, on needle prompts over generated prose, never the evaluation's), made SA
lowest-score-first. Its checkpoint (``static_router``) makes every head's logit a constant through the router's
input standardization, so a per-request ``elastic_bias`` of n - 0.5 sends exactly the n lowest-ranked heads to SA
through the same routing code as every other request. n = round(Omega x heads), where Omega is the variant's
realized mean Omega_MSR on that family (the table), or on the whole mix of qualified sensitive and robust families
(the value over static).

Requests go one at a time, greedy; each request's Omega_MSR is the change of the server's
``elastic:request_omega_msr`` sum over it (its count must grow by exactly one). Sensitive prompts score RULER's
string_match_all over the answer values (found = all of them); robust continuations (the haystack alone, a
completions request) the mean NLL of the prompt's last 128 tokens from ``prompt_logprobs``, compared with dense's
on the same prompts (paired difference, tolerance ``LOSS_TOL``); robust summaries (a chat request like the
retrieval prompts') are scored against dense's reply to the same prompt twice: the mean NLL of dense's reply
under the variant (one more request: the chat prompt and dense's reply as token ids, ``prompt_logprobs``; paired
difference to dense's own, tolerance ``SUMMARY_TOL``) and the ROUGE-L of the variant's own reply against it
(reported with its floor: dense's summaries of the family's other prompts against each other). Dense runs first: a sensitive family counts (a target) only when dense finds >= 70% of its answers.

Writes OUT/results.json (provenance, per-family table, value over static, targets), results.md, samples.jsonl.gz
and generalization.png. ``--resume`` keeps the samples of OUT/samples.jsonl.gz whose prompt and server
configuration are unchanged and runs only what is missing (a new variant on committed results).
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import json
import math
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

from elastic_vllm.config import FA_FLOOR_DEFAULT, ElasticConfig
from elastic_vllm.eval import heldout as H
from elastic_vllm.eval import metrics as M

MIN_DENSE = 70.0  # a sensitive family counts when dense finds at least this share (%) of its answers
TARGET_KEEP, TARGET_FLOOR, TARGET_ROBUST_MSR, TARGET_VALUE = 0.95, 0.90, 0.6, 5.0
# robust tolerance: a variant's mean continuation loss at most this many nats above dense's on a family
LOSS_TOL = 0.05
# and its summaries: the mean NLL of dense's reply under the variant at most this many nats above dense's own
SUMMARY_TOL = 0.05
BUILTIN = ("dense", "elastic", "static")
SERVED_NAME = "smollm2"
CPU_ARGS = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", "256M", "--max-num-seqs", "1"]


@dataclass(frozen=True)
class Variant:
    name: str
    server: dict = field(default_factory=dict)  # ElasticConfig fields over the base configuration
    xargs: dict = field(default_factory=dict)  # vllm_xargs of every request
    label: str = ""
    base: dict = field(default_factory=dict)  # the run's base configuration (sink, window, router_path)

    def config(self) -> dict:
        """The server's elastic configuration: base, then the variant's fields."""
        return {**self.base, **self.server}

    def key(self) -> str:
        """What makes a sample: the configuration as served, with the default fa_floor written out unless every
        request forces a mode (a force overrides the floor), so a changed default is a changed configuration."""
        cfg = self.config() if "elastic_force" in self.xargs else {"fa_floor": FA_FLOOR_DEFAULT, **self.config()}
        return json.dumps({"server": cfg, "xargs": self.xargs}, sort_keys=True)


def parse_variant(spec: str) -> Variant:
    """``NAME=JSON``: a server configuration (ElasticConfig fields) as one more variant."""
    name, sep, raw = spec.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"--variant {spec!r}: expected NAME=JSON, e.g. 'floor={{\"fa_floor\": 9}}'")
    name = name.strip()
    if name in BUILTIN or "@" in name:
        raise ValueError(f"--variant {name!r}: the name is taken (built-in: {', '.join(BUILTIN)}) or has '@'")
    ElasticConfig.parse(raw, prefix=f"--variant {name}")  # JSON, an object, known and valid fields: else it names them
    cfg = json.loads(raw)
    return Variant(name, cfg, {}, label=f"elastic, {json.dumps(cfg)}")


def variants(names: list[str], extra: list[str]) -> list[Variant]:
    out = [Variant("dense", {}, {"elastic_force": "all-FA"}, "dense (all FA)")] if "dense" in names else []
    if "elastic" in names:
        out.append(Variant("elastic", {}, {}, "elastic (default config, the router)"))
    out += [parse_variant(s) for s in extra]
    unknown = sorted(set(names) - set(BUILTIN) - {v.name for v in out})
    if unknown:
        raise ValueError(f"unknown variants {unknown}: built-in {', '.join(BUILTIN)}; others need --variant NAME=JSON")
    return out


# --- the static ranking ---------------------------------------------------------------------------------------------
def retrieval_ranking(model_dir: Path, tokenizer, n: int = 8, tokens: int = 1536, seed: int = 9001):
    """Retrieval score per (layer, KV head), float32 [L, H_kv]: needle prompts over generated prose (not the
    evaluation's prompts), dense attention, transformers float32 on the CPU."""
    import random

    import torch
    from transformers import AutoModelForCausalLM

    from elastic_vllm.eval.baselines import calibration_prompts, retrieval_scores

    gen = H.units("prose", random.Random(f"calibration:{seed}"))
    essay = " ".join(gen() for _ in range(40 * n))
    rows = calibration_prompts(tokenizer, essay, (tokens,), n, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return retrieval_scores(model, tokenizer, rows, torch.device("cpu"))


STATIC_OFFSET = 100.0  # keeps every pre-activation >= 100, where SiLU(x) = x in float32


def static_router(model_dir: Path, scores, path: Path) -> Path:
    """A router checkpoint whose margin z_FA - z_SA of (layer, KV head) is the head's rank by ``scores`` (0 = the
    lowest), whatever the prompt: the input standardization maps the pooled keys x to x * 1e-6 + (100 + rank) e_0,
    and each layer's MLPs carry coordinate 0 through (SiLU(v) = v for v >= 100) to the FA logit less 100."""
    import torch

    from elastic_vllm.router.checkpoint import BackboneMeta, BackboneShape, RouterMeta, save_router
    from elastic_vllm.router.model import FA_INDEX, ElasticRouter

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    shape = BackboneShape.from_hf_config(type("C", (), cfg))
    L, Hkv, D = shape.num_layers, shape.num_kv_heads, shape.head_dim
    if tuple(scores.shape) != (L, Hkv):
        raise ValueError(f"retrieval scores {tuple(scores.shape)} do not match the model's [{L}, {Hkv}] KV heads")
    rank = torch.empty(L * Hkv)
    rank[torch.argsort(scores.flatten().float(), stable=True)] = torch.arange(L * Hkv, dtype=torch.float32)
    r = ElasticRouter(L, D)
    with torch.no_grad():
        for layer in r.layers:
            for lin in (*layer.cls_feat_extractor[::2], *layer.cls_router_head_agnostic[::2]):
                lin.weight.zero_()
                lin.bias.zero_()
            for lin in (*layer.cls_feat_extractor[::2], *layer.cls_router_head_agnostic[:4:2]):
                lin.weight[0, 0] = 1.0
            last = layer.cls_router_head_agnostic[4]
            last.weight[FA_INDEX, 0] = 1.0
            last.bias[FA_INDEX] = -STATIC_OFFSET
    scale = torch.full((L, Hkv, D), 1e-6)
    shift = torch.zeros(L, Hkv, D)
    shift[..., 0] = -(STATIC_OFFSET + rank.view(L, Hkv)) / 1e-6
    r.set_input_norm(shift, scale)
    meta = RouterMeta(
        backbone=BackboneMeta(**shape.model_dump(), id=Path(model_dir).name, model_type=cfg.get("model_type", "?")),
        training={"note": "static ranking (eval/served.py): margin = rank by retrieval score, input-independent"},
    )
    return save_router(r, path, meta)


def static_bias(n_sa: int) -> float:
    """The per-request elastic_bias that sends the ``n_sa`` lowest-ranked heads of ``static_router`` to SA."""
    return n_sa - 0.5


# --- requests -------------------------------------------------------------------------------------------------------
def prompt_hash(p: H.Prompt) -> str:
    return hashlib.sha256(json.dumps([p.content, p.answers, p.max_tokens]).encode()).hexdigest()[:16]


def tail_loss(choice, n: int, what: str) -> float:
    """Mean NLL (nats) of the prompt's last ``n`` tokens from a completions choice with ``prompt_logprobs``: each
    position's entry is {token id: {"logprob": ...}} and holds the prompt's own token (``prompt_token_ids``)."""
    extra = choice.model_extra or {}
    lps, ids = extra.get("prompt_logprobs"), extra.get("prompt_token_ids")
    if not lps or not ids or len(lps) != len(ids):
        raise RuntimeError(f"{what}: the server returned no prompt_logprobs / prompt_token_ids for the prompt")
    if len(ids) <= n:
        raise RuntimeError(f"{what}: the prompt has {len(ids)} tokens, not more than the {n} to score")
    nll = []
    for lp, tid in zip(lps[-n:], ids[-n:]):
        e = (lp or {}).get(str(tid))
        if e is None:
            raise RuntimeError(f"{what}: prompt_logprobs lack the prompt's own token {tid}")
        nll.append(-float(e["logprob"]))
    return sum(nll) / n


def score(p: H.Prompt, res: dict, ref: dict | None = None) -> float:
    """Sensitive: RULER's string_match_all over the answer values (%). Continuation: the mean NLL of the scored
    tail. Summary: ROUGE-L F1 (x100) against ``ref``, dense's sample of the same prompt (NaN without one)."""
    if p.category == "sensitive":
        return M.string_match_all(M.postprocess_pred(res["pred"]), p.answers)
    if p.loss_tokens:
        return res["loss"]
    return M.rouge_l(res["pred"], ref["pred"]) if ref else float("nan")


def reply_prompt(tok, p: H.Prompt, reply: str) -> tuple[list[int], int]:
    """Token ids of ``p``'s chat prompt (the chat template, as the server renders it for a chat request) followed
    by ``reply``, and the reply's token count: what a completions request with ``prompt_logprobs`` scores."""
    text = tok.apply_chat_template([{"role": "user", "content": p.content}], add_generation_prompt=True, tokenize=False)
    head = tok.encode(text, add_special_tokens=False)
    tail = tok.encode(reply, add_special_tokens=False)
    if not tail:
        raise RuntimeError(f"{p.family} #{p.index}: dense's reply is empty: nothing to score a summary against")
    return head + tail, len(tail)


class Server:
    """One ``elastic-vllm serve`` of the model with an elastic configuration; ``ask`` sends one request and reads
    its Omega_MSR off /metrics."""

    def __init__(self, model: Path, elastic: dict, args: list[str], log_path: Path):
        from openai import OpenAI

        from elastic_vllm.server import ServeProcess

        env = {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = ServeProcess(model, elastic=elastic, args=args, served_name=SERVED_NAME, env=env, log_path=log_path)
        self.proc.wait_ready(900)
        self.client = OpenAI(base_url=self.proc.base + "/v1", api_key="unused", timeout=900)

    def _msr(self) -> tuple[float, float]:
        from elastic_vllm.server import metric_value

        m = self.proc.metrics()
        return metric_value(m, "elastic:request_omega_msr_sum"), metric_value(m, "elastic:request_omega_msr_count")

    def _routed(self, send, what: str):
        """``send()``'s response and the Omega_MSR of its one routing (the /metrics count must grow by one)."""
        s0, n0 = self._msr()
        out = send()
        s1, n1 = self._msr()
        if n1 - n0 != 1:
            raise RuntimeError(f"{what}: /metrics recorded {n1 - n0:g} routings for one request")
        return out, s1 - s0

    def _score_prompt(self, prompt: str | list[int], xargs: dict):
        """A completions request that scores its own prompt (``prompt_logprobs``) and writes 1 token."""
        return self.client.completions.create(
            model=SERVED_NAME,
            prompt=prompt,
            max_tokens=1,
            temperature=0,
            extra_body={"prompt_logprobs": 0, "return_token_ids": True, **({"vllm_xargs": xargs} if xargs else {})},
        )

    def ask(self, p: H.Prompt, xargs: dict) -> dict:
        what = f"{p.family} #{p.index}"
        t0 = time.perf_counter()
        if p.loss_tokens:  # robust: the completions API scores the prompt itself
            out, omega = self._routed(lambda: self._score_prompt(p.content, xargs), what)
            res = {"pred": "", "loss": tail_loss(out.choices[0], p.loss_tokens, what)}
        else:
            chat = dict(
                model=SERVED_NAME,
                messages=[{"role": "user", "content": p.content}],
                max_tokens=p.max_tokens,
                temperature=0,
                extra_body={"vllm_xargs": xargs} if xargs else None,
            )
            out, omega = self._routed(lambda: self.client.chat.completions.create(**chat), what)
            res = {"pred": out.choices[0].message.content or ""}
        secs = time.perf_counter() - t0
        return res | {"prompt_tokens": out.usage.prompt_tokens, "omega_msr": omega, "seconds": round(secs, 2)}

    def reply_loss(self, ids: list[int], n: int, xargs: dict, what: str) -> dict:
        """The mean NLL of the last ``n`` of ``ids`` (a chat prompt and a reply, ``reply_prompt``) under this
        server's routing of the request, and that request's own Omega_MSR (the router reads the reply too)."""
        out, omega = self._routed(lambda: self._score_prompt(ids, xargs), what)
        return {"loss": tail_loss(out.choices[0], n, what), "reply_tokens": n, "loss_omega_msr": omega}

    def stop(self) -> None:
        self.proc.stop()


# --- the run --------------------------------------------------------------------------------------------------------
def select_cells(patterns: list[str] | None) -> list[tuple[str, str, str]]:
    cells = H.design_cells()
    if not patterns:
        return cells
    got = [c for c in cells if any(fnmatch.fnmatch(H.family_name(*c), pat) for pat in patterns)]
    if not got:
        raise ValueError(f"--slice {patterns} matches no family; families: {[H.family_name(*c) for c in cells]}")
    return got


class Samples:
    """The run's samples, appended to OUT/samples.jsonl as they come (a crash loses nothing); with ``resume`` the
    earlier ones whose prompt hash and variant configuration match are kept."""

    def __init__(self, out: Path, resume: bool):
        self.path = out / "samples.jsonl"
        self.rows: dict[tuple, dict] = {}
        old = []
        if resume:
            for f in (self.path, out / "samples.jsonl.gz"):
                if f.is_file():
                    with gzip.open(f, "rt") if f.suffix == ".gz" else open(f) as fh:
                        old = [json.loads(x) for x in fh if x.strip()]
                    break
        for r in old:
            self.rows[self._key(r)] = r
        out.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as fh:
            for r in self.rows.values():
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
        self.resumed = len(self.rows)

    @staticmethod
    def _key(r: dict) -> tuple:  # the configuration, not the variant's name: a renamed variant keeps its samples
        return (r["variant_key"], r["family"], r["index"], r["prompt_hash"], r.get("n_sa"))

    def get(self, v: Variant, p: H.Prompt, n_sa: int | None = None) -> dict | None:
        return self.rows.get((v.key(), p.family, p.index, prompt_hash(p), n_sa))

    def add(self, r: dict) -> None:
        self.rows[self._key(r)] = r
        with open(self.path, "a") as fh:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")


def run(opts, argv: list[str], log=print) -> dict:
    from transformers import AutoTokenizer

    from elastic_vllm.models import fetch_demo_model

    t_start = time.perf_counter()
    model = Path(opts.model) if opts.model else fetch_demo_model(quiet=True)
    tok = AutoTokenizer.from_pretrained(model)
    out = Path(opts.out)
    extra = opts.variant or []
    names = opts.variants or [*BUILTIN, *(parse_variant(x).name for x in extra)]
    vs = [v for v in variants(names, extra) if v.name in names]
    if "dense" not in names:
        raise ValueError("--variants must include dense: it qualifies the families and is the robust reference")
    cells = select_cells(opts.slice)
    prompts = H.build_prompts(cells, opts.per_cell, tok, opts.prompt_tokens, opts.seed, opts.robust_per_cell)
    base = {
        "sink": opts.sink if opts.sink is not None else 128,
        "window": opts.window if opts.window is not None else 512,
    }
    if opts.router:
        base["router_path"] = str(Path(opts.router).resolve())
    vs = [replace(v, base=base) for v in vs]
    args = ["--max-model-len", str(opts.max_model_len)] + (CPU_ARGS if opts.device == "cpu" else [])
    if opts.dtype and opts.device != "cpu":
        args += ["--dtype", opts.dtype]
    samples = Samples(out, opts.resume)
    log(f"generalization (served): {len(prompts)} prompts in {len(cells)} families, variants {names} "
        f"{[v.name for v in vs if v.name not in BUILTIN]}; {samples.resumed} samples resumed")  # fmt: skip
    servers: dict[str, dict] = {}  # variant name -> server command and configuration
    by_fam: dict[str, list[H.Prompt]] = defaultdict(list)
    for p in prompts:
        by_fam[p.family].append(p)
    skipped: list[str] = []  # dense prompts of families that can no longer reach --min-dense
    earlier = out / "results.json"
    earlier_variants = json.loads(earlier.read_text()).get("variants", {}) if opts.resume and earlier.is_file() else {}

    def record(v: Variant, p: H.Prompt, res: dict, n_sa: int | None = None, ref: dict | None = None) -> dict:
        r = {"variant": v.name, "variant_key": v.key(), "family": p.family, "category": p.category, "kind": p.kind,
             "haystack": p.haystack, "placement": p.placement, "index": p.index, "prompt_hash": prompt_hash(p),
             "answers": p.answers, "n_sa": n_sa, **res}  # fmt: skip
        r["score"] = score(p, res, ref)
        r["found"] = bool(r["score"] == 100.0) if p.category == "sensitive" else None
        samples.add(r)
        return r

    def hopeless(p: H.Prompt) -> bool:
        """Dense can no longer reach --min-dense on p's family, whatever its remaining prompts find."""
        got = [samples.get(dense, q) for q in by_fam[p.family]]
        found = sum(bool(g and g["found"]) for g in got)
        return found + sum(g is None for g in got) < opts.min_dense / 100 * len(got)

    def run_on(v: Variant, todo: list[tuple[H.Prompt, int | None, dict]], elastic_cfg: dict) -> None:
        todo = [(p, n, x) for p, n, x in todo if samples.get(v, p, n) is None]
        servers[v.name] = {"elastic": elastic_cfg, "xargs": v.xargs, "key": v.key()}
        if not todo:  # every sample resumed: the command of the run that made them
            # the server that made them: by configuration (a variant may have been renamed, or be the default now)
            made = [e for e in earlier_variants.values() if e.get("key") == v.key()]
            servers[v.name]["command"] = made[0].get("command") if made else None
            return
        log(f"[{time.perf_counter() - t_start:7.0f}s] {v.name}: starting a server for {len(todo)} requests")
        srv = Server(model, elastic_cfg, args, out / f"serve-{v.name}.log")
        servers[v.name]["command"] = srv.proc.command
        try:
            t0, done = time.perf_counter(), 0
            for p, n_sa, xargs in todo:
                if v.name == "dense" and p.category == "sensitive" and hopeless(p):
                    skipped.append(f"dense {p.family} #{p.index}")
                    done += 1
                    continue
                res, ref = srv.ask(p, xargs), None
                if p.kind == "summarize":  # dense's reply (dense: the one just written) under this routing
                    ref = res if v is dense else samples.get(dense, p)
                    if ref is None:
                        raise RuntimeError(f"{v.name} {p.family} #{p.index}: no dense reply to score the summary by")
                    ids, n = reply_prompt(tok, p, ref["pred"])
                    res |= srv.reply_loss(ids, n, xargs, f"{v.name} {p.family} #{p.index} (dense's reply)")
                record(v, p, res, n_sa, ref)
                done += 1
                if done % 10 == 0 or done == len(todo):
                    eta = (time.perf_counter() - t0) / done * (len(todo) - done)
                    log(f"[{time.perf_counter() - t_start:7.0f}s] {v.name}: {done}/{len(todo)} (eta {eta:.0f} s)")
        finally:
            srv.stop()
        (out / f"serve-{v.name}.log").unlink(missing_ok=True)  # kept when the run failed

    # dense first: it qualifies the sensitive families and is the robust reference
    dense = vs[0]
    run_on(dense, [(p, None, dense.xargs) for p in prompts], dense.config())
    dense_found = {f: 100 * _mean([(samples.get(dense, p) or {}).get("found") for p in ps]) for f, ps in by_fam.items()
                   if ps[0].category == "sensitive"}  # fmt: skip
    dense_n = {f: sum(samples.get(dense, p) is not None for p in ps) for f, ps in by_fam.items()}
    qualified = {f for f, x in dense_found.items() if x >= opts.min_dense and dense_n[f] == opts.per_cell}
    mix = [p for p in prompts if p.category == "robust" or p.family in qualified]
    log(f"dense: {len(qualified)} of {len(dense_found)} sensitive families at >= {opts.min_dense:g}% "
        f"({', '.join(f'{f} {x:.0f}%' for f, x in sorted(dense_found.items()))})")  # fmt: skip

    routed = [v for v in vs[1:]]
    for v in routed:
        run_on(v, [(p, None, v.xargs) for p in mix], v.config())

    static_info: dict = {}
    if "static" in names:
        import torch

        earlier = next((f for f in (out / "static-scores.json", out / "results.json") if f.is_file()), None)
        src = opts.static_scores or (earlier if opts.resume else None)
        if src:  # a results.json of this suite ({"static": {"retrieval_scores": ...}}) or {"retrieval_scores": ...}
            d = json.loads(Path(src).read_text())
            d = d.get("static") or d
            if "retrieval_scores" not in d:
                raise ValueError(f"{src}: no retrieval_scores (expected a results.json of --suite generalization)")
            scores = torch.tensor(d["retrieval_scores"])
            where = str(src) if src != earlier else d.get("scores_from", str(src))
        else:
            t0 = time.perf_counter()
            scores = retrieval_ranking(model, tok)
            where = f"measured in this run ({time.perf_counter() - t0:.0f} s)"
            # kept for --resume: a re-measurement may differ in the last bits, and the samples name the ranking
            (out / "static-scores.json").write_text(
                json.dumps({"retrieval_scores": scores.tolist(), "scores_from": where})
            )
        heads = scores.numel()
        router = static_router(model, scores, out / "static-router")
        ranking = hashlib.sha256(json.dumps(scores.tolist()).encode()).hexdigest()[:16]
        # fa_floor 0: the static router has no ranking of its own, and its ranking already is the retrieval one
        static = Variant("static", {"static_ranking": ranking, "fa_floor": 0}, {}, "static ranking", base=base)
        todo: dict[tuple, tuple] = {}
        plan: dict[str, dict] = {}
        static_for = opts.static_for or [v.name for v in routed]
        unknown = sorted(set(static_for) - {v.name for v in routed})
        if unknown:
            raise ValueError(f"--static-for {unknown}: not a routed variant of this run ({[v.name for v in routed]})")
        for v in [v for v in routed if v.name in static_for]:  # at v's Omega per family, and over the whole mix
            om = {f: _mean([samples.get(v, p)["omega_msr"] for p in ps]) for f, ps in by_fam.items()
                  if any(p in mix for p in ps)}  # fmt: skip
            om_mix = _mean([samples.get(v, p)["omega_msr"] for p in mix])
            n_mix = round(om_mix * heads)
            plan[v.name] = {"omega_by_family": om, "n_sa_by_family": {f: round(o * heads) for f, o in om.items()},
                            "omega_mix": om_mix, "n_sa_mix": n_mix}  # fmt: skip
            for p in mix:
                n = round(om[p.family] * heads)
                todo[(p.family, p.index, n)] = (p, n, {"elastic_bias": static_bias(n)})
                if p.category == "sensitive":
                    todo[(p.family, p.index, n_mix)] = (p, n_mix, {"elastic_bias": static_bias(n_mix)})
        run_on(static, sorted(todo.values(), key=lambda t: (t[1], t[0].family, t[0].index)),
               {**base, "router_path": str(router.resolve()), "fa_floor": 0})  # fmt: skip
        servers["static"]["elastic"]["router_path"] = "OUT/static-router (static_router: the ranking below)"
        static_info = {"retrieval_scores": scores.tolist(), "scores_from": where, "heads": heads, "by_variant": plan,
                       "variant_key": static.key()}  # fmt: skip

    res = {
        "kind": "elastic-vllm generalization (served)",
        "provenance": _provenance(argv),
        "model": str(model),
        "router": str(opts.router) if opts.router else "shipped (router_weights/smollm2-135m-instruct)",
        "options": {
            "per_cell": opts.per_cell,
            "robust_per_cell": opts.robust_per_cell or opts.per_cell,
            "static_for": opts.static_for,
            "prompt_tokens": opts.prompt_tokens,
            "seed": opts.seed,
            "min_dense": opts.min_dense,
            "slice": opts.slice,
            "max_model_len": opts.max_model_len,
            "server_args": args,
        },
        "variants": {v.name: {"label": v.label, **servers.get(v.name, {})} for v in vs}
        | ({"static": {"label": "static ranking at the same Omega_MSR", **servers["static"]}} if static_info else {}),
        "design": [H.family_name(*c) for c in cells],
        "dense_stopped_early": skipped,
        "static": static_info,
    }
    res.update(aggregate(list(samples.rows.values()), prompts, vs, static_info, qualified, dense_found))
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    return write(res, samples, out, log)


def _mean(xs) -> float:
    xs = [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else float("nan")


def _se(xs: list[float]) -> float:
    """Standard error of the mean (sample standard deviation / sqrt(n)); NaN under 2 values."""
    if len(xs) < 2:
        return float("nan")
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def _provenance(argv: list[str]) -> dict:
    import platform

    import torch

    from elastic_vllm.eval.engine import provenance

    p = provenance(argv, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        import vllm

        p["vllm"] = vllm.__version__
    except ImportError:
        p["vllm"] = None
    p["machine"] = platform.machine()
    p["processor"] = platform.processor() or platform.machine()
    return p


def aggregate(rows: list[dict], prompts: list[H.Prompt], vs: list[Variant], static: dict, qualified: set,
              dense_found: dict) -> dict:  # fmt: skip
    """families[name] = {category, kind, haystack, placement, n, qualified, dense_found, variants: {variant:
    {n, found, score, omega_msr[, loss, loss_delta, loss_delta_se]}}}; a sample belongs to a variant by its
    configuration (``Variant.key``); the static ranking appears per variant v it matches as ``static@v`` (v's
    per-family Omega) and ``static@v-mix``; value over static and targets per routed variant. Robust: ``loss``
    the mean NLL of the scored tails, ``loss_delta`` its mean paired difference to dense's (same prompts), with
    its standard error."""
    keys = {(p.family, p.index): prompt_hash(p) for p in prompts}
    by: dict = defaultdict(dict)  # (family, variant key, n_sa) -> {index: row}
    for r in rows:
        if keys.get((r["family"], r["index"])) == r["prompt_hash"]:
            by[(r["family"], r["variant_key"], r["n_sa"])][r["index"]] = r
    fams: dict = {}
    for p in prompts:
        if p.family in fams:
            continue
        fams[p.family] = {"category": p.category, "kind": p.kind, "haystack": p.haystack, "placement": p.placement,
                          "qualified": p.family in qualified if p.category == "sensitive" else True,
                          "dense_found": dense_found.get(p.family), "variants": {}}  # fmt: skip

    def cell(xs: dict, ref: dict) -> dict:
        rs = list(xs.values())
        c = {"n": len(rs), "score": _mean([x["score"] for x in rs]),
             "found": 100 * _mean([x["found"] for x in rs]) if rs[0]["found"] is not None else None,
             "omega_msr": _mean([x["omega_msr"] for x in rs])}  # fmt: skip
        if rs[0].get("loss") is not None:
            d = [xs[i]["loss"] - ref[i]["loss"] for i in sorted(xs) if i in ref]
            c |= {"loss": _mean([x["loss"] for x in rs]), "loss_delta": _mean(d), "loss_delta_se": _se(d)}
        if rs[0].get("kind") == "summarize":  # against dense's reply now (dense's samples may be newer)
            r = [M.rouge_l(xs[i]["pred"], ref[i]["pred"]) for i in sorted(xs) if i in ref]
            c |= {"rouge": _mean(r), "rouge_se": _se(r)}
            if xs is ref:  # the floor: dense's summary of each prompt against its summary of the next one
                ix = sorted(xs)
                fl = [M.rouge_l(xs[a]["pred"], xs[b]["pred"]) for a, b in zip(ix, ix[1:] + ix[:1]) if a != b]
                c |= {"rouge_floor": _mean(fl)}
        return c

    static_key = static.get("variant_key")
    for f, d in fams.items():
        ref = by.get((f, vs[0].key(), None), {})  # dense
        d["summary"] = d["kind"] == "summarize"
        for v in vs:
            if by.get((f, v.key(), None)):
                d["variants"][v.name] = cell(by[(f, v.key(), None)], ref)
        for vname, plan in static.get("by_variant", {}).items():
            n = plan["n_sa_by_family"].get(f)
            if n is not None and by.get((f, static_key, n)):
                d["variants"][f"static@{vname}"] = cell(by[(f, static_key, n)], ref) | {"n_sa": n}
            if d["category"] == "sensitive" and by.get((f, static_key, plan["n_sa_mix"])):
                d["variants"][f"static@{vname}-mix"] = cell(by[(f, static_key, plan["n_sa_mix"])], ref) | {
                    "n_sa": plan["n_sa_mix"]
                }
        d["n"] = max((c["n"] for c in d["variants"].values()), default=0)
    out = {"families": fams, "value_over_static": {}, "targets": {}}
    sens = [f for f, d in fams.items() if d["category"] == "sensitive" and d["qualified"]]
    rob = [f for f, d in fams.items() if d["category"] == "robust"]
    for v in vs[1:]:
        val: dict = {}
        plan = static.get("by_variant", {}).get(v.name)
        mine = [fams[f]["variants"].get(v.name) for f in sens]
        if plan and mine and all(mine):
            st = [fams[f]["variants"].get(f"static@{v.name}-mix") for f in sens]
            if all(st):
                e = _mean([c["found"] for c in mine])
                s = _mean([c["found"] for c in st])
                # what routing can add over static at this Omega without finding more than all-FA does: where the
                # static ranking already finds what dense finds, no router can show value here, only at a sparser
                # operating point
                dn = _mean([fams[f]["variants"]["dense"]["found"] for f in sens])
                val = {"omega_mix": plan["omega_mix"], "static_omega": plan["n_sa_mix"] / static["heads"],
                       "families": len(sens), "sensitive_found": e, "static_found": s, "value": e - s,
                       "dense_found": dn, "headroom": dn - s, "met": bool(e - s >= TARGET_VALUE)}  # fmt: skip
        out["value_over_static"][v.name] = val
        out["targets"][v.name] = targets(fams, v.name, sens, rob, val)
    return out


def targets(fams: dict, v: str, sens: list[str], rob: list[str], val: dict) -> dict:
    per = {}
    for f in sens:
        c, d = fams[f]["variants"].get(v), fams[f]["variants"].get("dense")
        if not c or not d:
            continue
        keep = c["found"] / d["found"] if d["found"] else float("nan")
        miss = [] if keep >= TARGET_KEEP else [f"{100 * keep:.0f}% of dense < {100 * TARGET_KEEP:.0f}%"]
        if keep < TARGET_FLOOR:
            miss.append(f"below {100 * TARGET_FLOOR:.0f}% by {100 * (TARGET_FLOOR - keep):.0f} points")
        per[f] = {"keep": keep, "met": not miss, "miss": "; ".join(miss)}
    mine = {f: fams[f]["variants"][v] for f in rob if v in fams[f]["variants"]}
    rob_msr = _mean([c["omega_msr"] for c in mine.values()])
    loss = {f: c.get("loss_delta") for f, c in mine.items() if not fams[f].get("summary")}
    worse = {f: x for f, x in loss.items() if not x <= LOSS_TOL}  # NaN (no dense reference) counts as missed
    summ = {f: c.get("loss_delta") for f, c in mine.items() if fams[f].get("summary")}
    summ_worse = {f: x for f, x in summ.items() if not x <= SUMMARY_TOL}
    return {
        "sensitive": per,
        "sensitive_met": sum(x["met"] for x in per.values()),
        "robust_omega_msr": rob_msr,
        "robust_met": bool(rob_msr >= TARGET_ROBUST_MSR),
        "robust_loss_delta": loss,
        "robust_loss_delta_mean": _mean(list(loss.values())),
        "robust_loss_met": bool(mine) and not worse,
        "robust_loss_missed": sorted(worse),
        "robust_summary_loss_delta": summ,
        "robust_summary_rouge": {f: c.get("rouge") for f, c in mine.items() if fams[f].get("summary")},
        "robust_summary_met": not summ_worse if summ else None,
        "robust_summary_missed": sorted(summ_worse),
        "value_met": val.get("met"),
    }


def write(res: dict, samples: Samples, out: Path, log) -> dict:
    with gzip.open(out / "samples.jsonl.gz", "wt", encoding="utf-8", compresslevel=9) as f:
        for r in samples.rows.values():
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    samples.path.unlink(missing_ok=True)
    # results.json holds the ranking; the router folder (~30 MB) is rebuilt from it
    (out / "static-scores.json").unlink(missing_ok=True)
    shutil.rmtree(out / "static-router", ignore_errors=True)
    try:
        res["plots"] = [str(plot(res, out / "generalization.png").name)]
    except ImportError as e:
        res["plots"] = f"not written ({e}); run: python3 -m elastic_vllm.eval.served {out / 'results.json'}"
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "results.md").write_text(markdown(res))
    log(markdown(res))
    return res


# --- reports --------------------------------------------------------------------------------------------------------
def _f(x, nd=0) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _delta(x: float) -> str:
    """A loss difference in nats, signed, 3 decimals; one that rounds to zero is +0.000, not -0.000."""
    return f"{x:+.3f}" if round(x, 3) != 0 else "+0.000"


def columns(res: dict) -> list[tuple[str, str]]:
    """(column title, variant key) of the family table: dense, then each routed variant and its static match."""
    cols = [("dense", "dense")]
    for v in res["variants"]:
        if v in ("dense", "static"):
            continue
        cols.append((v, v))
        if res.get("static"):
            cols.append((f"static at {v}'s Omega", f"static@{v}"))
    return cols


def family_table(res: dict, target: str = "elastic") -> str:
    """The per-family table (the docs show it): found % (sensitive) or mean continuation loss (robust: dense in
    nats, the others as the difference to dense) / Omega_MSR; the last column checks ``target``'s targets."""
    cols = columns(res)
    lines = ["| family | n | " + " | ".join(c for c, _ in cols) + f" | target ({target}) |",
             "|---|---|" + "---|" * len(cols) + "---|"]  # fmt: skip
    tgt = res["targets"].get(target, {})
    fams = res["families"]
    order = sorted(
        fams,
        key=lambda f: (fams[f]["category"] != "sensitive", not fams[f]["qualified"], bool(fams[f].get("summary")), f),
    )
    for f in order:
        d = fams[f]
        cells = []
        for _, key in cols:
            c = d["variants"].get(key)
            if c is None:
                cells.append("-")
            elif d["category"] == "sensitive":
                cells.append(f"{_f(c['found'])} / {_f(c['omega_msr'], 2)}")
            elif d.get("summary") and key == "dense":
                cells.append(f"{_f(c['loss'], 3)}, 100 / {_f(c['omega_msr'], 2)}")
            elif d.get("summary"):
                cells.append(f"{_delta(c['loss_delta'])}, {_f(c.get('rouge'))} / {_f(c['omega_msr'], 2)}")
            elif key == "dense":
                cells.append(f"{_f(c['loss'], 3)} / {_f(c['omega_msr'], 2)}")
            else:
                cells.append(f"{_delta(c['loss_delta'])} / {_f(c['omega_msr'], 2)}")
        if d.get("summary"):
            x = tgt.get("robust_summary_loss_delta", {}).get(f)
            fl = f"; ROUGE-L floor {_f(d['variants'].get('dense', {}).get('rouge_floor'))}"
            verdict = ("-" if x is None else f"within {SUMMARY_TOL:g} nats{fl}" if x <= SUMMARY_TOL
                       else f"MISSED: {x:+.3f} nats > {SUMMARY_TOL:g}{fl}")  # fmt: skip
        elif d["category"] == "robust":
            x = tgt.get("robust_loss_delta", {}).get(f)
            verdict = ("-" if x is None else f"within {LOSS_TOL:g} nats" if x <= LOSS_TOL
                       else f"MISSED: {x:+.3f} nats > {LOSS_TOL:g}")  # fmt: skip
        elif not d["qualified"]:
            verdict = f"not counted: dense {_f(d['dense_found'])}% < {MIN_DENSE:g}%"
        else:
            t = tgt.get("sensitive", {}).get(f)
            verdict = "-" if t is None else ("met" if t["met"] else f"MISSED: {t['miss']}")
        lines.append(f"| {f} | {d['n']} | " + " | ".join(cells) + f" | {verdict} |")
    return "\n".join(lines) + "\n"


def summary_lines(res: dict) -> list[str]:
    out = []
    for v, val in res["value_over_static"].items():
        t = res["targets"][v]
        n_s = len(t["sensitive"])
        missed = t.get("robust_loss_missed") or []
        parts = []
        if t["robust_loss_delta"]:
            parts.append(
                f"continuation loss {t['robust_loss_delta_mean']:+.3f} nats vs dense on average (tolerance "
                f"{LOSS_TOL:g} per family: {'met' if t['robust_loss_met'] else 'missed on ' + ', '.join(missed)})"
            )
        summ = t.get("robust_summary_loss_delta") or {}  # absent from a results.json written before summaries
        if summ:
            sm = t["robust_summary_missed"]
            parts.append(
                f"dense's summaries {_mean(list(summ.values())):+.3f} nats under it on average (tolerance "
                f"{SUMMARY_TOL:g} per family: {'met' if not sm else 'missed on ' + ', '.join(sm)}), its own "
                f"summaries' ROUGE-L vs dense's {_mean(list(t['robust_summary_rouge'].values())):.0f}"
            )
        robust = (
            f"robust mean Omega_MSR {_f(t['robust_omega_msr'], 2)} (target >= {TARGET_ROBUST_MSR}: "
            f"{'met' if t['robust_met'] else 'missed'}), " + ", ".join(parts)
            if parts
            else "no robust family in this run (--slice)"
        )
        out.append(f"- {v}: sensitive targets met in {t['sensitive_met']} of {n_s} families; {robust}")
        if val:
            gap = "met" if val["met"] else f"missed by {TARGET_VALUE - val['value']:.1f}"
            # a results.json written before the headroom was recorded renders without it
            room = (
                f"; dense finds {val['dense_found']:.1f}%, so at this Omega routing can add at most "
                f"{val['headroom']:+.1f} points over static"
                if "headroom" in val
                else ""
            )
            out.append(
                f"- value over static ({v}): on the mix of {val['families']} qualified sensitive and the robust "
                f"families, {v} realizes mean Omega_MSR {val['omega_mix']:.2f}; at that Omega "
                f"({val['static_omega']:.2f} in whole heads) the static ranking finds {val['static_found']:.1f}% of "
                f"the sensitive answers, {v} {val['sensitive_found']:.1f}%: {val['value']:+.1f} points (target >= "
                f"+{TARGET_VALUE:g}: {gap}){room}"
            )
    return out


def markdown(res: dict) -> str:
    p = res["provenance"]
    lines = [
        "# Generalization (served): held-out families through `elastic-vllm serve`",
        "",
        f"Model `{res['model']}`, router {res['router']}; vLLM {p.get('vllm')}, torch {p['torch']}, {p['gpu']} "
        f"({p.get('processor')}, {p['host_cpu_count']} CPUs), commit {p['git_commit'][:12]}"
        f"{' (dirty)' if p['git_dirty'] else ''}. Command: `{p['command']}`",
        "",
        "Cells: found % (sensitive: every answer value in the reply) / mean Omega_MSR, over n prompts of "
        f"~{res['options']['prompt_tokens']} tokens; robust: the mean NLL (nats) of each prompt's last "
        f"{H.LOSS_TOKENS} tokens, dense's, and the others' difference to it on the same prompts; summaries: the mean "
        "NLL of dense's reply (dense's, then the difference to it) and the ROUGE-L of the variant's own reply against "
        "dense's (dense = 100). Static: heads ranked "
        "by retrieval score, the lowest SA, as many as the routed variant's mean Omega_MSR on the family.",
        "",
        family_table(res),
        *summary_lines(res),
        "",
        f"Wall {res['wall_s']:.0f} s.",
    ]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> Path:
    """Per family and column: found % (sensitive) or continuation loss - dense's in nats (robust) as bars, and
    Omega_MSR as dots (right axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = res["families"]
    cols = columns(res)
    groups = [
        (
            "sensitive (counted)",
            [f for f, d in sorted(fams.items()) if d["category"] == "sensitive" and d["qualified"]],
        ),
        (
            "robust (continuation loss)",
            [f for f, d in sorted(fams.items()) if d["category"] == "robust" and not d.get("summary")],
        ),
        ("robust (summary: loss of dense's reply)", [f for f, d in sorted(fams.items()) if d.get("summary")]),
    ]
    groups = [(t, fs) for t, fs in groups if fs]
    fig, axes = plt.subplots(
        len(groups), 1, figsize=(max(8, 0.9 * max(len(fs) for _, fs in groups) + 3), 4.2 * len(groups)), squeeze=False
    )
    colors = ["black", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink"]
    for ax, (title, fs) in zip(axes[:, 0], groups):
        sens, summ = title.startswith("sensitive"), "summary" in title
        metric = "found" if sens else "loss_delta"
        here = [(k, c) for k, c in enumerate(cols) if any(c[1] in fams[f]["variants"] for f in fs)]
        if not sens:  # dense is the reference (a difference of 0, a ROUGE-L of 100)
            here = [(k, c) for k, c in here if c[1] != "dense"]
        w = 0.8 / max(1, len(here))
        ax2 = ax.twinx()
        for j, (k, (name, key)) in enumerate(here):
            ys = [fams[f]["variants"].get(key, {}).get(metric, float("nan")) for f in fs]
            om = [fams[f]["variants"].get(key, {}).get("omega_msr", float("nan")) for f in fs]
            xs = [i + (j - (len(here) - 1) / 2) * w for i in range(len(fs))]
            ax.bar(xs, [float("nan") if y is None else y for y in ys], width=w, color=colors[k % len(colors)],
                   alpha=0.75, label=name)  # fmt: skip
            ax2.plot(xs, om, "D", color=colors[k % len(colors)], markeredgecolor="black", markersize=5)
        ax.set_xticks(range(len(fs)), fs, rotation=30, ha="right", fontsize=8)
        if sens:
            ax.set_ylim(0, 105)
            ax.set_ylabel("found % (bars)", fontsize=8)
        else:
            tol = SUMMARY_TOL if summ else LOSS_TOL
            ax.axhline(tol, color="gray", linestyle="--", linewidth=1)
            ax.set_ylabel(f"loss - dense, nats (bars; dashed: tolerance {tol:g})", fontsize=8)
        ax2.set_ylim(0, 1.05)
        ax2.set_ylabel("Omega_MSR (dots)", fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.08, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":  # re-plot from a results.json
    import sys

    r = json.loads(Path(sys.argv[1]).read_text())
    print(plot(r, Path(sys.argv[1]).parent / "generalization.png"))
