"""Router training on tiny random backbones: the recipe moves routing and lambdas, the fast attention
path equals the reference oracle, resume is exact, outputs are complete, torchrun + FSDP works."""

import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch

from elastic_vllm.hf.testing import save_tiny_model
from elastic_vllm.router.checkpoint import BackboneShape, load_router
from elastic_vllm.train.config import TrainConfig
from elastic_vllm.train.loop import lr_factor, tau_at, train

pytestmark = pytest.mark.usefixtures("one_thread")

ELASTIC = {"sink": 4, "window": 16}


def write_data(path, n=16, seed=0):
    """A sensitive task (find a code far back) and a robust one (continue local text); ~150-250 bytes."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            filler = " ".join("".join(rng.choice("abcdefghij") for _ in range(4)) for _ in range(rng.randint(20, 35)))
            if i % 2 == 0:
                k, v = "".join(rng.choice("KLMN") for _ in range(3)), str(rng.randint(100, 999))
                row = {
                    "task": "kv",
                    "category": "sensitive",
                    "messages": [{"role": "user", "content": f"The code for {k} is {v}. {filler} Code for {k}?"}],
                    "answer": v,
                }
            else:
                row = {
                    "task": "cont",
                    "category": "robust",
                    "messages": [{"role": "user", "content": "Continue: " + filler}],
                    "answer": filler[:20],
                }
            f.write(json.dumps(row) + "\n")
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    return {
        "llama": str(save_tiny_model("llama", root / "llama")),
        "qwen3": str(save_tiny_model("qwen3", root / "qwen3")),
        "data": str(write_data(root / "data.jsonl")),
    }


def run(env, out, family="llama", **kw):
    cfg = dict(
        model=env[family],
        data=env["data"],
        out=str(out),
        elastic=ELASTIC,
        steps=6,
        batch_size=2,
        progress=False,
        plots=False,
        save_every=100,
        rank_prompts=0,  # the ranking has its own test (test_training_stores_the_retrieval_ranking)
    )
    cfg.update(kw)
    summary = train(TrainConfig(**cfg))
    log = [json.loads(ln) for ln in (out / "train_log.jsonl").read_text().splitlines()]
    return summary, log


def test_schedules():
    cfg = TrainConfig(model="m", data="d", out="o", steps=100)
    assert lr_factor(cfg, 0) == pytest.approx(1 / 20) and lr_factor(cfg, 19) == 1.0
    assert lr_factor(cfg, 99) < 0.01
    assert tau_at(cfg, 0) == 1.5 and tau_at(cfg, 60) == pytest.approx(1.0, abs=1e-3) and tau_at(cfg, 99) == 1.0
    exp = cfg.model_copy(update={"tau_schedule": "exp", "tau_final": 0.5})
    assert tau_at(exp, 99) == pytest.approx(1.5 * 2.718281828 ** (-0.6))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_routing_moves_toward_targets_and_lambdas_move(env, tmp_path, family):
    """|Omega - t| (the constraint the Lagrangian enforces) falls; the multipliers move from their start."""
    _, log = run(
        env,
        tmp_path / family,
        family,
        steps=12,
        batch_size=4,
        router_lr=3e-2,
        lambda_lr=0.1,
        lambda_init=1.0,
        warmup=0.1,
    )

    def gap(r):
        return sum(r["gap"].values()) / len(r["gap"])

    first, last = log[:3], log[-3:]
    assert sum(map(gap, last)) / 3 < sum(map(gap, first)) / 3 - 0.05
    for cat in ("robust", "sensitive"):
        moved = abs(log[-1]["lambdas"][cat]["lambda1"] - 1.0)
        assert moved > 0.1, (cat, log[-1]["lambdas"])
    assert log[-1]["lambdas"]["robust"]["lambda2"] > 1.0  # ascent on lambda2 * d^2 only goes up


def test_fast_path_and_reference_give_the_same_losses(env, tmp_path):
    """float32: the banded-SDPA training path and the plain per-head reference agree to ~1e-6 relative
    on every logged quantity; asserted at rtol 1e-4 so a wrong mask (~1e-2 effects) fails."""
    _, fast = run(env, tmp_path / "fast", steps=3, impl="torch")
    _, ref = run(env, tmp_path / "ref", steps=3, impl="reference")
    for a, b in zip(fast, ref):
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=1e-4)
        assert a["reg_loss"] == pytest.approx(b["reg_loss"], rel=1e-4, abs=1e-7)
        assert a["omega"] == pytest.approx(b["omega"], abs=1e-6)
    ra = load_router(tmp_path / "fast" / "router").router.state_dict()
    rb = load_router(tmp_path / "ref" / "router").router.state_dict()
    for k in ra:
        torch.testing.assert_close(ra[k], rb[k], atol=1e-5, rtol=1e-4)


def test_batched_forwards_equal_one_sequence_per_forward(env, tmp_path):
    """Right-padded micro-batches (several sequences per forward, no padding mask) give what one
    forward per sequence gives: every logged quantity and the trained router."""
    _, one = run(env, tmp_path / "one", steps=3, batch_size=4, microbatch_tokens=1)
    _, many = run(env, tmp_path / "many", steps=3, batch_size=4, microbatch_tokens=4096)
    for a, b in zip(one, many):
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=1e-5)
        assert a["reg_loss"] == pytest.approx(b["reg_loss"], rel=1e-5, abs=1e-7)
        assert a["omega"] == pytest.approx(b["omega"], abs=1e-6)
        assert a["omega_argmax"] == b["omega_argmax"]
    ra = load_router(tmp_path / "one" / "router").router.state_dict()
    rb = load_router(tmp_path / "many" / "router").router.state_dict()
    for k in ra:
        torch.testing.assert_close(ra[k], rb[k], atol=1e-5, rtol=1e-4)


def test_microbatches_group_by_length_within_the_budget():
    from elastic_vllm.train.loop import microbatches

    groups = microbatches([50, 10, 30, 200, 20], 90)
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3, 4]
    assert groups == [[1, 4, 2], [0], [3]]  # 3 x 30 = 90 fits; 50 alone (2 x 50 > 90); 200 > budget alone


def test_resume_is_exact(env, tmp_path):
    _, full = run(env, tmp_path / "full", steps=4, save_every=2)
    _, part = run(env, tmp_path / "part", steps=4, save_every=2, stop_after=2)
    assert len(part) == 2 and not (tmp_path / "part" / "router").exists()
    _, resumed = run(env, tmp_path / "part", steps=4, save_every=2, resume=True)
    assert [r["lm_loss"] for r in resumed] == [r["lm_loss"] for r in full]
    a = load_router(tmp_path / "full" / "router").router.state_dict()
    b = load_router(tmp_path / "part" / "router").router.state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)


def test_training_stores_the_retrieval_ranking(env, tmp_path):
    """The finish step measures the backbone's retrieval-head ranking (eval.baselines.retrieval_scores on the
    calibration prompts) and stores it with what measured it; fa_floor then loads it from the checkpoint."""
    from elastic_vllm.config import ElasticConfig
    from elastic_vllm.eval.baselines import retrieval_scores
    from elastic_vllm.router.policy import floor_of
    from elastic_vllm.train.ranking import calibration_records

    hay = tmp_path / "hay.txt"
    hay.write_text(
        " ".join(f"Sentence {i} tells of the {w} near the river." for i, w in enumerate(["oak", "fox"] * 60))
    )
    run(env, tmp_path / "o", steps=2, rank_prompts=2, rank_lengths=(300,), rank_haystack=str(hay))
    ck = load_router(tmp_path / "o" / "router")
    cal = ck.meta.retrieval.calibration
    assert cal["prompts"] == 2 and cal["lengths"] == [300] and cal["haystack"] == "hay.txt" and cal["seed"] == 1042
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(env["llama"])
    model = AutoModelForCausalLM.from_pretrained(env["llama"], dtype=torch.float32, attn_implementation="sdpa")
    records, desc = calibration_records(tok, (300,), 2, haystack=hay)
    assert desc["inputs_sha256"] == cal["inputs_sha256"]
    want = retrieval_scores(model, tok, records)  # the frozen backbone: the same scores as a fresh measurement
    torch.testing.assert_close(ck.router.retrieval_scores, want, atol=1e-5, rtol=1e-4)
    assert floor_of(ck.router, ElasticConfig(fa_floor=2)).sum() == 2


def test_outputs_checkpoint_logs_and_plots(env, tmp_path):
    summary, log = run(env, tmp_path / "o", steps=3, plots=True, save_every=2, elastic={**ELASTIC, "window": 24})
    out = tmp_path / "o"
    ck = load_router(out / "router", expect=BackboneShape(num_layers=3, num_kv_heads=2, head_dim=16))
    assert ck.meta.attention["window"] == 24 and ck.meta.attention["mode"] == "FA-SSA"
    assert ck.meta.pooling == {"mode": "boundary", "tokens": 100}
    assert ck.meta.training["steps"] == 3 == ck.meta.training["steps_planned"] and set(ck.meta.training["tasks"]) == {
        "kv",
        "cont",
    }
    assert json.loads((out / "summary.json").read_text())["data_sha256"] == summary["data_sha256"]
    for k in ("lm_loss", "reg_loss", "omega", "omega_argmax", "lambdas", "tau", "gap"):
        assert k in log[0]
    assert sorted(p.name for p in (out / "plots").glob("*.png")) == sorted(
        f"{n}.png" for n in ("lm_loss", "reg_loss", "omega_msr", "gap", "lambdas", "tau", "curves")
    )
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["LATEST", "step_000002", "step_000003"]
    assert (out / "checkpoints" / "LATEST").read_text().strip() == "step_000003"


def test_torchrun_two_processes_fsdp_matches_one_process(env, tmp_path):
    """torchrun --nproc_per_node 2 (gloo, CPU): FSDP-sharded frozen backbone, replicated router."""
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun not on PATH")
    out2 = tmp_path / "two"
    cmd = [
        "torchrun",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "elastic_vllm.cli",
        "train-router",
        "--model",
        env["llama"],
        "--data",
        env["data"],
        "--out",
        str(out2),
        "--elastic",
        json.dumps(ELASTIC),
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--device",
        "cpu",
        "--no-plots",
        "--no-progress",
    ]
    envv = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=envv, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    two = [json.loads(ln) for ln in (out2 / "train_log.jsonl").read_text().splitlines()]
    _, one = run(env, tmp_path / "one", steps=2, batch_size=4)
    for a, b in zip(two, one):
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=1e-5)
        assert a["omega"] == pytest.approx(b["omega"], abs=1e-6)
    a = load_router(out2 / "router").router.state_dict()
    b = load_router(tmp_path / "one" / "router").router.state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


def test_training_forward_backward_has_no_host_sync():
    """Host syncs stall a launch-bound GPU step (a 135M model is): the training path must have none
    between the forward's start and the end of backward (F.one_hot, .item(), bool(tensor) all sync)."""
    from torch.profiler import ProfilerActivity, profile

    from elastic_vllm.hf import enable_elastic
    from elastic_vllm.hf.testing import tiny_model
    from elastic_vllm.router.model import ElasticRouter
    from elastic_vllm.train.data import Example
    from elastic_vllm.train.loop import gumbel_noise, sequence_loss

    model = tiny_model("qwen3")
    state = enable_elastic(model, ELASTIC, ElasticRouter(3, 16).requires_grad_(True))
    model.train()
    ex = Example("t", "robust", tuple(range(60)), 50)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        res = sequence_loss(model, state, ex, gumbel_noise(0, 0, 0, 3, 2), 1.2, torch.device("cpu"))
        (res["ce"] + res["omega"]).backward()
    syncs = [e.name for e in prof.events() if e.name in ("aten::_local_scalar_dense", "aten::item")]
    assert not syncs


def test_time_budget_fits_the_schedule_then_stops(env, tmp_path, monkeypatch):
    """A fake clock (+1 s per reading): after the timed steps the planned steps shrink to fit the
    budget and the LR schedule follows (ends near 0); a budget already spent stops at once."""
    import types

    import elastic_vllm.train.loop as loop

    clock = iter(range(10**6))
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(time=lambda: float(next(clock))))
    monkeypatch.setattr(loop, "FINISH_RESERVE_S", 0.0)
    summary, log = run(env, tmp_path / "fit", steps=40, batch_size=1, time_budget_s=30)
    fitted = summary["steps_fitted_to_time_budget"]
    assert 6 < fitted < 40 and summary["steps"] == len(log) <= fitted
    assert log[-1]["lr_router"] < 0.2 * max(r["lr_router"] for r in log) or "stopped_early_at_step" in summary
    assert (tmp_path / "fit" / "router" / "router.json").is_file()

    summary, log = run(env, tmp_path / "spent", steps=40, batch_size=1, time_budget_s=1)
    assert summary["stopped_early_at_step"] == 1 and len(log) == 1
    assert (tmp_path / "spent" / "router" / "router.safetensors").is_file()


@pytest.mark.parametrize("mode", ["FA-XA", "XA-SSA"])
def test_xattention_modes_train(env, tmp_path, mode):
    """XA sides (block selection without gradient, dense per-head masks) train too."""
    elastic = {**ELASTIC, "mode": mode, "xattn_block": 16, "xattn_stride": 4}
    _, log = run(env, tmp_path / mode, steps=2, elastic=elastic)
    assert all(torch.isfinite(torch.tensor(r["lm_loss"])) for r in log)
    assert load_router(tmp_path / mode / "router").meta.attention["mode"] == mode


def test_cli_closes_the_process_group_it_trained_under(tmp_path):
    """train-router destroys the torchrun process group before exit (left to interpreter teardown, a gloo rank
    of the 2-process test once aborted: 'terminate called without an active exception')."""
    import torch.distributed as dist

    from elastic_vllm.train.cli import close_process_group

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    assert dist.is_initialized()
    close_process_group()
    assert not dist.is_initialized()
    close_process_group()  # nothing to close: no error
