"""Fixtures of the vLLM tests: real vLLM CPU engines in this process, routers with known decisions.

Engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set before vLLM is imported) so tests read
the backend's counters and routing registry directly. float32 everywhere: bf16 matmuls are ~4x slower
on this CPU and float32 makes the comparison with transformers tight.
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from .helpers import close_llm  # noqa: F401  (the engine tests import it from here)
from .routers import (
    SMOLLM2_RETRIEVAL_HEADS,
    head_selecting_rules,
    linear_router,
    save_test_router,
)

REPO = Path(__file__).resolve().parents[2]
KV_BYTES = 256 << 20


def pytest_collection_modifyitems(config, items):
    if not any(e.name == "elastic" for e in entry_points(group="vllm.general_plugins")):
        raise pytest.UsageError(
            "the elastic vLLM plugin entry point is not installed (or a stale elastic_vllm.egg-info shadows it): "
            "run `pip install -e .` in the repository"
        )


def pytest_collection_finish(session):
    """Boot the `vllm serve` of test_serve.py now: it starts in the background while other tests run."""
    if any(Path(str(item.fspath)).name == "test_serve.py" for item in session.items):
        from . import server

        server.start()


def pytest_sessionfinish(session, exitstatus):
    from . import server

    server.stop()


@pytest.fixture(scope="session")
def hf_ref(demo_model_dir):
    """transformers SmolLM2 (float32) with attn_implementation="elastic" and pre-RoPE key hooks; shared,
    so every user sets its router and knobs with ``configure`` (all-FA = the dense model)."""
    from .hf_ref import HFElasticReference

    return HFElasticReference(demo_model_dir, {"force": "all-FA"})


def calibration_prompts(tok) -> list[list[int]]:
    from elastic_vllm.eval.needle import make_needle_prompt

    chats = [
        "What is the capital of France?",
        "Write a poem about the sea.",
        "Summarize: The quick brown fox jumps over the lazy dog. " * 20,
    ]
    texts = [
        tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
        for c in chats
    ]
    texts.append(make_needle_prompt(tok, 300, seed=0).text(tok))
    return [tok(t).input_ids for t in texts]


@pytest.fixture(scope="session")
def smollm2_pooled(hf_ref):
    """Pooled pre-RoPE keys [N prompts, L, Hkv, D] of calibration prompts (transformers, dense)."""
    hf_ref.configure(None, force="all-FA")
    return torch.stack([hf_ref.pooled(ids) for ids in calibration_prompts(hf_ref.tok)])


@pytest.fixture(scope="session")
def retrieval_router(tmp_path_factory, smollm2_pooled) -> Path:
    """A SmolLM2 router constructed to keep the 10 best retrieval heads of SmolLM2 (routers.SMOLLM2_RETRIEVAL_HEADS) FA (and
    every other head SA): known decisions, so the needle tests check the serving path, not the quality
    of a trained router (the shipped one is measured by scripts/measure_trained_router.py and run by
    tests/e2e/test_demo.py)."""
    r = linear_router(30, 64, head_selecting_rules(smollm2_pooled, SMOLLM2_RETRIEVAL_HEADS))
    return save_test_router(
        r, tmp_path_factory.mktemp("router") / "retrieval", 3, "HuggingFaceTB/SmolLM2-135M-Instruct"
    )


def make_llm(model, **kw):
    from vllm import LLM

    args = dict(enforce_eager=True, kv_cache_memory_bytes=KV_BYTES, dtype="float32", max_model_len=4096, seed=0)
    args.update(kw)
    return LLM(str(model), **args)


def elastic_states():
    from elastic_vllm.vllm_plugin import state

    return state.live_states()


def state_of(llm):
    """The elastic EngineState of an in-process engine."""
    from elastic_vllm.vllm_plugin import state

    st = state.for_config(llm.llm_engine.vllm_config, create=False)
    assert st is not None, "no elastic state for this engine"
    return st
