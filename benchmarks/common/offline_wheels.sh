#!/usr/bin/env bash
# slidedp's dependencies that a GPU machine without network may lack (OR-Tools and what it needs), as wheels
# for its Python, into one git-ignored folder (default .whl/ at the repository root) to carry there with the
# tree. torch, numpy, transformers, numba, networkx and jinja2 are expected there already.
#
#   bash benchmarks/common/offline_wheels.sh [FOLDER]
#
# There, before a benchmark: python -m pip install -q --no-index --no-deps --target /tmp/site FOLDER/*.whl
# and PYTHONPATH=/tmp/site. Environment: PYTHON (default: the repository's .venv/bin/python, or python3),
# TARGET_PYTHON (default 3.12), and the versions below, pinned to those the tests run with.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:-$ROOT/.whl}"
TARGET="${TARGET_PYTHON:-3.12}"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
version() { "$PYTHON" -c "import importlib.metadata as m; print(m.version('$1'))"; }
# OR-Tools and its requirements (pandas: cp_model imports it), at the versions installed here
PACKAGES=()
for name in ortools protobuf absl-py immutabledict pandas python-dateutil tzdata; do
    PACKAGES+=("$name==$(version "$name")")
done
mkdir -p "$OUT"
"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "$TARGET" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$OUT" "${PACKAGES[@]}"
ls -l "$OUT"
