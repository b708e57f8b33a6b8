#!/usr/bin/env bash
# GPU smoke check on a bare CUDA box: the box's own python and torch (>= 2.10, CUDA build), this
# checkout, no network. Everything else comes from bench/wheels (fill it with
# bench/fetch_wheels.sh where the package index is reachable; it travels with the checkout):
# the wheels this Python lacks at the carried versions are installed with
# `pip install --no-index --no-deps` into a venv that sees the system site packages, so the
# box's torch is the one used. Then `python -m bench.gpu_smoke` runs every section under its own
# budget and appends its JSON lines to OUT as each variant finishes (bench/gpu_smoke/ says more).
#
#   bash bench/gpu_smoke.sh [OUT.jsonl]    # QUICK=1: the 6-minute budgets; DRY=1: CPU dry mode
#                                          # PYTHON=... the interpreter; SMOKE_VENV=... the venv
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
out="${1:-smoke.jsonl}"
wheels="${WHEELS:-$root/bench/wheels}"
venv="${SMOKE_VENV:-${TMPDIR:-/tmp}/fsdp_fp8-smoke-venv}"
flags=(${QUICK:+--quick} ${DRY:+--dry})
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv || true

# A venv over the system site packages (keeps the box's torch); without ensurepip (no
# python3-venv package) the system pip installs into it through --python.
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv --system-site-packages "$venv" 2>/dev/null \
        || "$python" -m venv --system-site-packages --without-pip "$venv"
fi
vpy="$venv/bin/python"
if "$vpy" -m pip --version >/dev/null 2>&1; then pip=("$vpy" -m pip); else pip=("$python" -m pip --python "$vpy"); fi
mapfile -t todo < <(PYTHONPATH="$root" "$vpy" -m bench.gpu_smoke --out /dev/null --wheels "$wheels" --wheels-to-install)
if [ "${#todo[@]}" -gt 0 ]; then
    echo "installing ${#todo[@]} carried wheels into $venv"
    if ! "${pip[@]}" install --quiet --no-index --no-deps --find-links "$wheels" "${todo[@]}"; then
        # one wheel this Python cannot take (another Python version) must not stop the others
        for wheel in "${todo[@]}"; do
            "${pip[@]}" install --quiet --no-index --no-deps "$wheel" 2>/dev/null || echo "not installed: $(basename "$wheel")" >&2
        done
        echo "the preflight section names what is still missing" >&2
    fi
fi

export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# The driver ends each section at its own budget; this outer limit is their sum plus a margin,
# a backstop that never cuts a section short.
limit=$("$vpy" -m bench.gpu_smoke --out /dev/null --outer-timeout "${flags[@]}")
exec timeout "$limit" "$vpy" -m bench.gpu_smoke --out "$out" --wheels "$wheels" "${flags[@]}"
