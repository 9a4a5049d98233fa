#!/usr/bin/env bash
# What the GPU machine needs to run the DeepSpeed ZeRO-Offload baselines of
# benchmarks/single_gpu_throughput/run.py, into one git-ignored folder (default .deepspeed-wheels/ at the
# repository root), to carry there: that machine has no network, Python 3.12 and torch already.
#
#   bash benchmarks/common/deepspeed_wheels.sh [FOLDER]
#
# It holds:
#   * deepspeed-VERSION.tar.gz: DeepSpeed's sdist from PyPI (to build it there instead, should the wheel not do);
#   * deepspeed-VERSION-py3-none-any.whl: that sdist built here with DS_BUILD_OPS=0, pure Python: no op is
#     compiled in, each (DeepSpeedCPUAdam's cpu_adam among them) is JIT-compiled with ninja and the machine's
#     C++ compiler where it first runs, for that machine's CPU (-march=native). setup.py imports torch, so
#     the build needs torch importable here (any build, CPU included; what it records of it is used only
#     for ops compiled in, and there are none);
#   * DeepSpeed's dependencies as CPython 3.12 manylinux / pure wheels (torch and numpy left out: they are
#     there), and nvidia-ml-py (DeepSpeed's CUDA accelerator uses it when present);
#   * SHA256SUMS.
# On the GPU machine (benchmarks/single_gpu_throughput/README.md has the whole command):
#   python -m pip install --no-index --find-links .deepspeed-wheels deepspeed==VERSION
#
# Environment: PYTHON (default: python3, or the repository's .venv/bin/python when present), DEEPSPEED_VERSION
# (default 0.19.8, the version the benchmark was written against), TARGET_PYTHON (default 3.12).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:-$ROOT/.deepspeed-wheels}"
VERSION="${DEEPSPEED_VERSION:-0.19.8}"
TARGET="${TARGET_PYTHON:-3.12}"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

mkdir -p "$OUT"
echo "== DeepSpeed $VERSION sdist from PyPI"
"$PYTHON" -m pip download --no-deps --no-binary=:all: "deepspeed==$VERSION" -d "$OUT"

echo "== the wheel, no ops compiled in (DS_BUILD_OPS=0)"
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel --no-deps --no-build-isolation -w "$OUT" "$OUT/deepspeed-$VERSION.tar.gz"
WHEEL="$OUT/deepspeed-$VERSION-py3-none-any.whl"
test -f "$WHEEL"

echo "== its dependencies for CPython $TARGET (torch and numpy are on the GPU machine)"
mapfile -t DEPS < <("$PYTHON" - "$WHEEL" <<'EOF'
import sys, zipfile
from email.parser import Parser
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    reqs = Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []
for r in reqs:
    if "extra ==" in r:
        continue
    name = r.split(";")[0].strip()
    base = name.split("<")[0].split(">")[0].split("=")[0].split("!")[0].split("~")[0].strip().lower()
    if base not in ("torch", "numpy"):
        print(name)
print("nvidia-ml-py")
EOF
)
echo "   ${DEPS[*]}"
ABI="cp${TARGET/./}"
"$PYTHON" -m pip download --only-binary=:all: --python-version "$TARGET" --implementation cp --abi "$ABI" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any -d "$OUT" "${DEPS[@]}"

(cd "$OUT" && sha256sum -- *.whl *.tar.gz > SHA256SUMS)
echo "== $OUT ($(du -sh "$OUT" | cut -f1)):"
ls -1 "$OUT"
