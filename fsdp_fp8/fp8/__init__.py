"""FP8 tensors and linears: static per-tensor E4M3 weights, the ops and all-gather hooks FSDP2
needs on them, and the W8A8 / W8A16 forward. Knows nothing of files or checkpoints.

Importing any module of this layer registers the FSDP2 ops (``fsdp_fp8.fp8.ops``), and imports
TorchAO with its import-time notices quieted (``fsdp_fp8.third_party``)."""

from fsdp_fp8.third_party import quiet_imports

with quiet_imports():  # this is where fsdp_fp8 first imports TorchAO: its import-time notices
    from fsdp_fp8.fp8 import ops as _ops  # noqa: F401  (registration on import)
