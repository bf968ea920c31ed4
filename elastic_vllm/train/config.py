"""TrainConfig: the router-training recipe (the paper's, Section 3), every knob with its documented default.

Defaults and where they come from:

| knob | default | source |
|---|---|---|
| steps | 300 | paper (Table 6) |
| input_norm_samples | 64 prompts | ours: per-(layer, KV head) standardization of the router input, measured before step 1 (router/model.py says why) |
| microbatch_tokens | 32768 padded tokens per forward | ours (speed: one forward per group of sequences, not per sequence; same result) |
| router_lr | 5e-4 | paper |
| lambda_lr | 1e-3, own param group, no weight decay | paper; the authors' code also decays the lambdas (a bug, not copied) |
| betas, weight_decay | (0.9, 0.95), 0.1 | authors' code |
| schedule | linear warmup over the first 20% of steps, then cosine to 0 (both param groups) | paper |
| grad_clip | 5.0 (router parameters) | authors' code |
| tau | "cosine": 1.5 -> 1.0 over the first 60% of steps, then 1.0 | authors' code; "exp" = the paper's max(tau_min, tau_init * exp(-0.6 p)) |
| linear_term | "signed": lambda1 * (Omega - t) | paper's equation; "abs" = the authors' code's lambda1 * abs(Omega - t) |
| Ldiff | per sequence: Omega_MSR of that sequence (straight-through) minus its task's target | paper eq. 8 (per input X); the step's loss is the mean over its sequences |
| targets | robust 1.0, sensitive 0.7 | paper (the authors' script used 0.6 for sensitive) |
| lambda_init | 0.0 | ours (the paper initialises them randomly; 0 keeps runs comparable) |
| pooling | boundary, first/last 100 prompt tokens | paper's inference (the authors' training pooled the whole user turn) |
| elastic | ElasticConfig() (FA-SSA, sink 128, window 2048) | paper; for SmolLM2 at <= 8K the scripts pass window 512 (at 4K-8K, window 256 lost about twice as much needle accuracy as 512) |

Why "signed" by default: with ascent, lambda1 then acts as a proper Lagrange multiplier of the
constraint Omega = t (it changes sign when Omega crosses t); with "abs" lambda1 only grows and the
term becomes a ratchet toward t from both sides.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from elastic_vllm.config import ElasticConfig

CATEGORIES: tuple[str, ...] = ("sensitive", "robust")


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="transformers model folder (frozen backbone)")
    data: str = Field(description="training mixture JSONL (.jsonl or .jsonl.gz) from `elastic-vllm build-data`")
    out: str = Field(description="output folder: router/, checkpoints/, train_log.jsonl, plots/, summary.json")
    elastic: ElasticConfig = Field(
        default_factory=ElasticConfig, description="attention config trained with (recorded in the checkpoint)"
    )
    steps: int = Field(300, ge=1)
    batch_size: int = Field(8, ge=1, description="sequences per optimizer step, over all ranks")
    max_tokens: int = Field(8192, ge=16, description="longer sequences are skipped")
    microbatch_tokens: int = Field(
        32768,
        ge=1,
        description="padded tokens (rows x longest row) per forward: a step's sequences are sorted by length "
        "and grouped into right-padded batches of at most this size (1 = one sequence per forward)",
    )
    router_lr: float = Field(5e-4, gt=0)
    lambda_lr: float = Field(1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(0.1, ge=0)
    warmup: float = Field(0.2, ge=0, lt=1, description="share of steps with linear LR warmup")
    grad_clip: float = Field(5.0, gt=0)
    tau_schedule: Literal["cosine", "exp", "constant"] = "cosine"
    tau_init: float = Field(1.5, gt=0)
    tau_final: float = Field(1.0, gt=0, description="cosine: final tau; exp: tau_min")
    tau_anneal: float = Field(0.6, gt=0, le=1, description="cosine: share of steps over which tau anneals")
    tau_exp_rate: float = Field(0.6, gt=0, description="exp: tau = max(tau_final, tau_init * exp(-rate * p))")
    linear_term: Literal["signed", "abs"] = "signed"
    targets: dict[str, float] = Field(default_factory=lambda: {"robust": 1.0, "sensitive": 0.7})
    lambda_init: float = 0.0
    gumbel: bool = True
    seed: int = 0
    impl: Literal["torch", "reference"] = "torch"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    device: str = "auto"
    gradient_checkpointing: bool = True
    input_norm_samples: int = Field(
        64,
        ge=0,
        description="prompts (over all ranks) whose pooled keys fix the router's per-(layer, KV head) input "
        "standardization before training; 0 = none (the authors' router)",
    )
    fsdp: bool = True
    save_every: int = Field(50, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    log_every: int = Field(1, ge=1)
    resume: bool = False
    stop_after: int | None = Field(None, ge=1, description="end this run after N more steps (checkpointed)")
    time_budget_s: float | None = Field(
        None, gt=0, description="stop early (router, summary and plots still written) once the next step would pass it"
    )
    plots: bool = True
    progress: bool = True
    # the retrieval-head ranking stored in the router (the fail-safe floor's, train/ranking.py), measured when
    # training finishes on calibration needle prompts that are not evaluation prompts
    rank_prompts: int = Field(8, ge=0, description="calibration needle prompts per length for the ranking (0: none)")
    rank_lengths: tuple[int, ...] = Field((4096, 8192), min_length=1, description="calibration prompt lengths")
    rank_haystack: str | None = Field(None, description="text file hiding the needles (default: the essays)")
    backbone_id: str | None = None

    @field_validator("targets")
    @classmethod
    def _targets(cls, v: dict[str, float]) -> dict[str, float]:
        missing = set(CATEGORIES) - set(v)
        if missing:
            raise ValueError(f"targets needs a value for every category {CATEGORIES}, missing {sorted(missing)}")
        bad = {k: t for k, t in v.items() if not 0.0 <= t <= 1.0}
        if bad:
            raise ValueError(f"targets must be sparsity shares in [0, 1], got {bad}")
        return v

    @field_validator("elastic", mode="before")
    @classmethod
    def _elastic(cls, v):
        cfg = ElasticConfig.parse(v)
        if cfg.force != "auto":
            raise ValueError("training routes every head: elastic.force must be 'auto'")
        if cfg.fa_floor:
            raise ValueError("training routes every head: elastic.fa_floor must be 0 (the floor is a serving knob)")
        return cfg
