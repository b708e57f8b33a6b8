#!/usr/bin/env bash
# Fill bench/wheels (or $1) with every wheel the GPU smoke check installs on a box that has
# torch (CUDA build, Python 3.12) and no network: this package's runtime dependencies
# (torchao, safetensors, numpy), the demo's (diffusers, transformers, tokenizers,
# huggingface_hub and their pure-Python dependencies) and the test runner for tests/gpu
# (pytest, pytest-timeout). Run it on any machine that reaches the package index; the
# directory is ignored by git and travels with the checkout (bench/gpu_smoke.sh installs from
# it with `pip install --no-index --find-links`). Versions are pinned: the ones the CPU suite
# runs (constraints.txt) and the dependencies pip resolved for them for CPython 3.12 on
# manylinux x86_64. Budget: at most 60 MiB in total; the script fails above it.
#
#   bash bench/fetch_wheels.sh [DIR]        # PYTHON=... picks the pip; PYTHON_VERSION=3.12
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$root/bench/wheels}"
python="${PYTHON:-python3}"
pyver="${PYTHON_VERSION:-3.12}"
limit_mib=60
# One line per wheel; bench/gpu_smoke/preflight.py reads this same list (WHEELS below the
# marker) to name each missing file.
# --- wheels ---
wheels=(
    torchao==0.18.0 safetensors==0.8.0 numpy==2.4.6
    diffusers==0.42.1 transformers==5.14.1 tokenizers==0.22.2 huggingface_hub==1.33.0
    filelock==4.3.1 fsspec==2026.9.0 hf-xet==1.8.0 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0
    anyio==4.16.0 idna==3.20 certifi==2026.10.19.post1 packaging==26.4 pyyaml==6.0.4
    regex==2026.11.19 tqdm==4.70.1 typing_extensions==4.16.0 importlib_metadata==10.2.0
    zipp==4.1.2 pillow==13.0.0 requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3
    typer==0.29.2 click==8.5.1 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
    shellingham==1.5.4 annotated-doc==0.0.7 lazy-importer==0.1.0 pydantic==2.14.4
    pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    pytest==9.2.0 pytest-timeout==2.4.0 pluggy==1.7.0 iniconfig==2.3.1
)
# --- end ---
mkdir -p "$dest"
"$python" -m pip download --dest "$dest" --no-deps --only-binary=:all: --python-version "$pyver" \
    --implementation cp --abi "cp${pyver/./}" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any --progress-bar off --quiet "${wheels[@]}"
total=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
ls -1 "$dest"/*.whl | xargs -n1 basename
echo "$(ls -1 "$dest"/*.whl | wc -l) wheels, $((total / 1048576)) MiB in $dest"
if (( total > limit_mib * 1048576 )); then
    echo "over the ${limit_mib} MiB budget: the checkout would not travel to the GPU box" >&2
    exit 1
fi
