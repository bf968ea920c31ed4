import json
import os
import random

import pytest
import torch
from testlib import missing_test_extras

# Triton kernels run on the CPU through the interpreter in CI.
os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    missing = missing_test_extras()
    if missing:
        raise pytest.UsageError(
            f"the tests need what `bash scripts/install.sh test` installs; missing here: {', '.join(missing)} "
            "(fix: run `bash scripts/install.sh test` once, then pytest again)"
        )


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    random.seed(0)


@pytest.fixture(scope="session")
def demo_model_dir():
    """The real demo model (SmolLM2-135M-Instruct), fetched and converted by the product's own function."""
    from elastic_vllm.models import fetch_demo_model

    return fetch_demo_model(quiet=True)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices: one intra-op thread is faster, and far faster on a shared 2-core machine (35 ms vs 1.4 ms
    per 512x64 linear measured with other jobs running; the demo model's forwards 6-10x)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# Stand-ins for the training mixture's sources (the builder, its families and the eval suites that reuse them)
WORDS = "alpha beta gamma delta river stone cloud field light paper window garden".split()


def _sentences(rng, n):
    return " ".join(" ".join(rng.choice(WORDS) for _ in range(8)).capitalize() + "." for _ in range(n))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Same layout and formats as the fetched sources, a few KB each."""
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("sources")
    lce = root / "lce"
    lce.mkdir()
    squad = {"version": "v2.0", "data": []}
    for a in range(20):
        paras = []
        for p in range(3):
            ctx = _sentences(rng, 3) + f" The keeper of hall {a}-{p} is Mira{a}{p}."
            qas = [{"id": f"q{a}{p}", "question": f"Who keeps hall {a}-{p}?", "answers": [{"text": f"Mira{a}{p}"}]}]
            paras.append({"context": ctx, "qas": qas})
        squad["data"].append({"title": f"Article {a}", "paragraphs": paras})
    (lce / "squad.json").write_text(json.dumps(squad))
    hotpot = []
    for i in range(40):
        ctx = [[f"Title {i}-{j}", [_sentences(rng, 2)]] for j in range(4)]
        kind = "comparison" if i % 3 == 0 else "bridge"
        hotpot.append(
            {
                "_id": f"h{i}",
                "question": f"Question {i} about {rng.choice(WORDS)}?",
                "answer": f"ans{i}",
                "context": ctx,
                "type": kind,
            }
        )
    (lce / "hotpotqa.json").write_text(json.dumps(hotpot))
    essays = "".join(f"{m} 20{10 + i}" + _sentences(rng, 40) for i, m in enumerate(["March", "May", "June"] * 4))
    (lce / "PaulGrahamEssays.json").write_text(json.dumps({"text": essays}))
    sotu = root / "sotu"
    sotu.mkdir()
    for y in range(1900, 1912):
        (sotu / f"{y}_someone_x.json").write_text(json.dumps({"year": y, "text": _sentences(rng, 60)}))
    rst = root / "linuxdoc" / "rst" / "admin"
    rst.mkdir(parents=True)
    for i in range(12):
        body = "\n\n".join(_sentences(rng, 5) for _ in range(8))
        lead = f"This document describes how the subsystem number {i} works and how to configure it safely."
        (rst / f"doc{i}.rst").write_text(
            f".. _doc{i}:\n\n=========\nDoc {i}\n=========\n\n:Author: X\n\n{lead}\n\n{body}\n"
        )
    std = root / "stdlib" / "pkg"  # stands in for the Python standard library
    std.mkdir(parents=True)
    for i in range(12):
        funcs = "".join(f"def f{j}(x):\n    return x + {j}\n\n\n" for j in range(40))
        (std / f"mod{i}.py").write_text(
            f'"""Helpers number {i}: small functions that add constants to numbers."""\n\n{funcs}'
        )
    return root
