import os
import random

import pytest
import torch

# Triton kernels run on the CPU through the interpreter in CI.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    random.seed(0)


@pytest.fixture(scope="session")
def demo_model_dir():
    """The real demo model (SmolLM2-135M-Instruct), fetched and converted by the product's own function."""
    from elastic_vllm.models import fetch_demo_model

    return fetch_demo_model(quiet=True)


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """Fresh output poisoned with NaN: an element a kernel forgets to write fails the comparison."""
    return torch.full_like(t, float("nan"))
