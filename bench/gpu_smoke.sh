#!/usr/bin/env bash
# GPU smoke check on a bare CUDA box, under 8 minutes on one H100/H200: the box's own python
# and torch (>= 2.10), this checkout on PYTHONPATH, no install, no network. Writes one JSON
# (default smoke.json): versions and capability, every FP8 GEMM against fp32, _scaled_mm seen
# by the profiler, the uint8 all-gather hooks at 3 and 8 ranks, load GB/s, one 64B-model
# layer's step time per precision, the demo under torchrun twice. bench/gpu_smoke.py says more.
#
# Carried wheels, only for what the box lacks, in $WHEELS (default bench/wheels); they are
# unpacked into a temporary directory on PYTHONPATH, never installed:
#   torchao-0.18.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
#   safetensors-0.8.0-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
#   numpy-<version>-<the box's python tag>-manylinux_*.whl      (only if the box has no numpy)
#
#   bash bench/gpu_smoke.sh [OUT.json]        # PYTHON=... picks the interpreter; DRY=1: CPU
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
out="${1:-smoke.json}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv || true
exec timeout 480 "$python" "$root/bench/gpu_smoke.py" --out "$out" --wheels "${WHEELS:-$root/bench/wheels}" ${DRY:+--dry}
