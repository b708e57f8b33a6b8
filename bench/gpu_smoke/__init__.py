"""GPU smoke check for a bare CUDA box: figures per section, written as they are measured.

    bash bench/gpu_smoke.sh smoke.jsonl                       # on the GPU box (installs the wheels)
    python -m bench.gpu_smoke --out smoke.jsonl [--quick]     # the same, wheels already importable
    python -m bench.gpu_smoke --dry --out smoke.jsonl         # CPU, scaled-down shapes
    python -m bench.gpu_smoke --fake-cuda --out smoke.jsonl   # CPU build, fake CUDA tensors

From the repository root (``bench/gpu_smoke.sh`` puts it on ``PYTHONPATH`` itself). One module
per section (``preflight``, ``versions``, ``gpu_tests``, ``gemm``, ``load``, ``step``,
``collectives`` for ``allgather`` and ``alltoall``, ``demo``, ``attention``, ``decode``),
``sections`` names them in order, ``context`` holds what they share, ``driver`` runs them.

It measures; it does not judge correctness. The correctness checks (FP8 GEMMs against an fp32
reference, ``_scaled_mm`` in the profiler, the all-gather hooks' bytes, NCCL loads and the demo
at one and many GPUs) are the tests in ``tests/gpu``, which the ``tests`` section runs with
pytest and reports test by test.

Each section runs in a child process under its own time budget (``driver.BUDGETS``; ``--quick`` fits
all of them in 6 minutes on one H200), and every variant of a section in its own ``try``. The
results file is JSON lines, appended and flushed as each variant finishes: a record per
variant ``{"section", "variant", "status", ...figures}``, a record closing each section
(``"variant": null``: ``ok``, ``failed``, ``timeout``, ``crashed`` or ``skipped``, with its
seconds and the end of its stderr), and a last ``summary``. A timeout or a crash keeps what
finished; ``context.load_results`` folds the file back into one dict.

Sections:
  preflight  what is missing, by name, before any work: each carried wheel (bench/fetch_wheels.sh
             lists them) by file name, each module the sections import, a C compiler and
             ``Python.h`` (torch.compile's fused kernels), a CUDA device of capability >= 8.9
  versions   python, torch, CUDA, NCCL, torchao, device name, capability and count
  tests      pytest on tests/gpu, one record per test (--quick leaves out the two-world demo test)
  gemm       ms and TFLOP/s of each FP8 linear mode (BF16, W8A8, W8A8 fast accumulation, W8A8
             fused quantization, W8A16, W8A16 fused) at the 64B model's shapes, and each one's
             relative error against fp32 as a figure
  load       GB/s of ``load_model`` onto the device (cold page cache) against the floors of the
             same files: raw read, host-to-device (pinned, pageable), read + copy; load / floor in
             time and CPU seconds per GB (user and sys) of the load and the raw read; then load and
             ``LoadedModel.close()`` five times: ``torch.cuda.memory_allocated`` (RSS on the CPU)
             after each close against before the first load
  step       one layer of the 64B model (hidden 5120, 4096 latent + 256 prompt tokens), CFG step
             (2 forwards) per precision and kernel option
  allgather  the uint8 all-gather of uneven shards (zero-row ranks included) under torchrun at
             the largest world the box allows (one GPU per rank), ms and GB/s per weight shape
  alltoall   Ulysses attention's all-to-alls (q/k/v to heads, the output back) under torchrun at
             the largest world the box allows, the 64B model's 720p video among the shapes: the
             rows and heads every rank gets back, ms and GB/s (needs 2 GPUs; --dry: gloo, 3 ranks)
  demo       ``torchrun launch/infer.py`` at min(8, GPU count) ranks under NCCL: seconds, load,
             digest, watchdog/terminate lines; then once with ``--cache seacache``: the steps
             computed and reused, the wall ratio to the uncached run, whether the latent differs
  attention  one 720p-sized attention call (44,160 rows, Super-sized GQA heads, bf16) per attention
             backend this GPU can run (--attention-backend's names), ms and TFLOP/s; the others
             skipped with the reason the launcher would give
  decode     a Wan 2.2-shaped VAE (random weights, BF16) at 720p: one rank's tiled decode against
             the split over every GPU (``bench.vae_decode_ranks`` under torchrun): seconds and each
             rank's peak allocated, the frames compared byte for byte; on fake CUDA the gather's
             packing (tests/unit/test_fake_cuda_vae_decode.py's check)

``--dry`` runs every section on the CPU with small shapes (what CI can run); ``--fake-cuda``
runs the CUDA code paths of ``gemm``, ``step`` and ``allgather`` on fake CUDA tensors
(``fake_cuda``; torch's fake process group for the all-gather), so CUDA's layout,
alignment and device rules are checked on a CPU build; there nothing is timed, and the
sections fake CUDA cannot run say why. The exit code is 1 if any section failed or timed out.
"""
