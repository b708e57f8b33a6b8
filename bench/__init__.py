"""The benchmarks: one module per bench, each run from the repository root as a module.

    python -m bench.cache --help
    torchrun --nproc-per-node 4 -m bench.load --size small --reps 1

``common`` holds what they share (model sizes, the cached checkpoints, memory sampling, the
results file); ``harness`` how they start ranks and processes and time them; ``gpu_smoke`` is
the GPU smoke check, one module per section. docs/benchmarks.md has each bench's current
figures and the command that reproduces them.
"""
