#!/usr/bin/env bash
# The test command: install what the tests need, lint, run the suite (CPU machine, no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m pytest -q -ra "$@"
