"""Third-party messages that never concern a user of the launcher or the CLI, silenced by name.

The application layer may quiet other libraries (the library itself never does). Each entry
is one message, matched by the logger that emits it and a fragment of its text; nothing else
those loggers say is touched. docs/usage.md lists them.
"""

from __future__ import annotations

import logging

DIFFUSERS_LOADERS = ("diffusers.models.modeling_utils", "diffusers.pipelines.pipeline_utils")
# (the loggers that emit it, a fragment of its text, why it does not concern the user)
QUIET: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (
        ("torchao",),
        "Failed to load",
        "TorchAO's optional CUDA kernels (_C_mxfp8, cutlass) do not load on this build; fsdp_fp8 uses none",
    ),
    (
        ("torchao.kernel.intmm",),
        "Detected no triton",
        "TorchAO's int8 matmul kernels need Triton; fsdp_fp8 never calls them",
    ),
    (
        ("torch.utils._pytree",),
        "is an Enum subclass and is now natively supported",
        "a deprecation aimed at TorchAO's own Enum registrations, not at anything fsdp_fp8 calls",
    ),
    (
        ("diffusers.quantizers.torchao.torchao_quantizer", "diffusers.quantizers.torchao"),
        "Unable to import `torchao` Tensor objects",
        "diffusers' TorchAO quantizer, for checkpoints serialized by TorchAO: fsdp_fp8 reads ModelOpt files",
    ),
    (
        DIFFUSERS_LOADERS,
        "`accelerate` was not found",
        "the 6-line 'pip install accelerate' advice: fsdp_fp8 builds on the meta device, without it",
    ),
    (
        ("diffusers.models.modeling_utils",),
        "that should be kept in float32",
        "the notice that some modules stay float32: the checkpoint's own dtypes are what is loaded",
    ),
)


class _Quiet(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)  # the template too: TorchAO formats before logging, torch after
        try:
            text += record.getMessage()
        except (TypeError, ValueError):
            pass
        return not any(f in text for f in self.fragments)


def quiet_third_party() -> None:
    """Attach the filters (once per process): call before the libraries are imported."""
    by_logger: dict[str, list[str]] = {}
    for names, fragment, _why in QUIET:
        for name in names:
            by_logger.setdefault(name, []).append(fragment)
    for name, fragments in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Quiet) for f in logger.filters):
            logger.addFilter(_Quiet(tuple(fragments)))
