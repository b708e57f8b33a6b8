#!/usr/bin/env bash
# GPU smoke run for one CUDA GPU, under 5 minutes: the GPU tests, the demo loaded and sampled
# with NCCL at world size 1, then bench/forward.py at world size 1. Results append to
# bench/results.jsonl; paste the printed tables into docs/benchmarks.md (GPU section).
#
#   bash bench/gpu_smoke.sh            # PYTHON / TORCHRUN override the interpreters
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
TORCHRUN=${TORCHRUN:-.venv/bin/torchrun}
export FSDP_FP8_CACHE=${FSDP_FP8_CACHE:-$(mktemp -d)/cache}
export FSDP_FP8_BENCH_DIR=${FSDP_FP8_BENCH_DIR:-$(mktemp -d)/bench}

nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

echo "== tests/gpu"
timeout 120 "$PYTHON" -m pytest -q tests/gpu

echo "== launch/infer.py, NCCL, world size 1"
timeout 90 "$TORCHRUN" --nproc-per-node 1 launch/infer.py --steps 20 --report "$FSDP_FP8_BENCH_DIR/infer.json"

echo "== bench/forward.py, world size 1"
timeout 90 "$TORCHRUN" --nproc-per-node 1 bench/forward.py --device cuda --size small --steps 10 --reps 3
if [[ "${FULL:-0}" == 1 ]]; then  # the ~1 GB model: its one-time export takes ~1-2 min on CPU
  timeout 240 "$TORCHRUN" --nproc-per-node 1 bench/forward.py --device cuda --size default --steps 10 --reps 3
fi
