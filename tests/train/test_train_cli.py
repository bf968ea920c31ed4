"""`elastic-vllm train-router`'s flags reach the TrainConfig fields of the same name."""

import argparse

from elastic_vllm.train.cli import config_from_args, train_router_args


def test_every_flag_reaches_its_config_field():
    p = argparse.ArgumentParser()
    train_router_args(p)
    a = p.parse_args(
        ["--model", "m", "--data", "d.jsonl", "--out", "o", "--steps", "7", "--batch-size", "3", "--seed", "5",
         "--router-lr", "0.01", "--tau-schedule", "exp", "--window", "64", "--sink", "4", "--no-gumbel",
         "--target-robust", "0.9", "--target-sensitive", "0.2", "--time-budget-s", "60"]
    )  # fmt: skip
    cfg = config_from_args(a)
    assert (cfg.model, cfg.data, cfg.out, cfg.steps, cfg.batch_size, cfg.seed) == ("m", "d.jsonl", "o", 7, 3, 5)
    assert cfg.router_lr == 0.01 and cfg.tau_schedule == "exp" and cfg.time_budget_s == 60
    assert (cfg.elastic.window, cfg.elastic.sink) == (64, 4)
    assert cfg.gumbel is False and cfg.plots is True and cfg.fsdp is True
    assert cfg.targets == {"robust": 0.9, "sensitive": 0.2}
    defaults = config_from_args(p.parse_args(["--model", "m", "--data", "d", "--out", "o"]))
    for name in ("steps", "router_lr", "lambda_lr", "warmup", "tau_init", "seed", "save_every", "rank_prompts"):
        assert getattr(defaults, name) == type(defaults).model_fields[name].default, name
