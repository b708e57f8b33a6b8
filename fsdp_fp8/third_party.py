"""Other libraries' messages that never concern a user of fsdp_fp8, and the one way to quiet them.

Each entry of ``QUIET`` is one message, matched by the logger that emits it and a fragment of its
text; nothing else those loggers say is touched. Two users:

- the library quiets the ones printed while a library is imported, and only around its own
  imports (``quiet_imports``): a filter is added to each emitting logger for the block and
  removed after it, so ``import fsdp_fp8`` and a ``load_model`` call print none of them, while
  the user's own logging set-up (handlers, levels, ``warnings`` filters) is never changed;
- the launcher and the CLI (an application, which may) quiet every entry for the whole process
  (``fsdp_fp8.cli.quiet``). docs/usage.md lists them.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

DIFFUSERS_LOADERS = ("diffusers.models.modeling_utils", "diffusers.pipelines.pipeline_utils")
# (the loggers that emit it, a fragment of its text, printed on import, why it does not concern the user)
QUIET: tuple[tuple[tuple[str, ...], str, bool, str], ...] = (
    (
        ("torchao",),
        "Failed to load",
        True,
        "TorchAO's optional CUDA kernels (_C_mxfp8, cutlass) do not load on this build; fsdp_fp8 uses none",
    ),
    (
        ("torchao.kernel.intmm",),
        "Detected no triton",
        True,
        "TorchAO's int8 matmul kernels need Triton; fsdp_fp8 never calls them",
    ),
    (
        ("torch.utils._pytree",),
        "is an Enum subclass and is now natively supported",
        True,
        "a deprecation aimed at TorchAO's own Enum registrations, not at anything fsdp_fp8 calls",
    ),
    (
        ("diffusers.quantizers.torchao.torchao_quantizer", "diffusers.quantizers.torchao"),
        "Unable to import `torchao` Tensor objects",
        True,
        "diffusers' TorchAO quantizer, for checkpoints serialized by TorchAO: fsdp_fp8 reads ModelOpt files",
    ),
    (
        DIFFUSERS_LOADERS,
        "`accelerate` was not found",
        False,
        "the 6-line 'pip install accelerate' advice: fsdp_fp8 builds on the meta device, without it",
    ),
    (
        ("diffusers.models.modeling_utils",),
        "that should be kept in float32",
        False,
        "the notice that some modules stay float32: the checkpoint's own dtypes are what is loaded",
    ),
)

# Python warnings of the same kind, dropped while diffusers loads a pipeline's components for
# ``load_pipeline`` (``quiet_warnings``): (category, a fragment of the message, why)
QUIET_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (
        FutureWarning,
        "`torch.nn.utils.weight_norm` is deprecated",
        "torch's deprecation of a call inside diffusers' Cosmos 3 sound tokenizer, printed at each of its loads",
    ),
)


class QuietFilter(logging.Filter):
    """Drops a logger's records whose text holds one of ``fragments``."""

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


def fragments_by_logger(import_time_only: bool = False) -> dict[str, tuple[str, ...]]:
    """``QUIET`` as logger name -> the fragments to drop there."""
    by_logger: dict[str, list[str]] = {}
    for names, fragment, on_import, _why in QUIET:
        if on_import or not import_time_only:
            for name in names:
                by_logger.setdefault(name, []).append(fragment)
    return {name: tuple(fragments) for name, fragments in by_logger.items()}


@contextlib.contextmanager
def quiet_imports(import_time_only: bool = True) -> Iterator[None]:
    """Drop ``QUIET``'s import-time messages (``import_time_only=False``: every entry, for a block
    that also loads with diffusers) while the block runs (fsdp_fp8 imports TorchAO or diffusers in
    it); every logger is as it was afterwards."""
    added = []
    for name, fragments in fragments_by_logger(import_time_only=import_time_only).items():
        logger, quiet = logging.getLogger(name), QuietFilter(fragments)
        logger.addFilter(quiet)
        added.append((logger, quiet))
    try:
        yield
    finally:
        for logger, quiet in added:
            logger.removeFilter(quiet)


@contextlib.contextmanager
def quiet_warnings() -> Iterator[None]:
    """Drop ``QUIET_WARNINGS`` raised in the block and show every other warning after it, as it
    would have been shown; no warning filter is set (the user's ``warnings`` set-up stays as it was)."""
    with warnings.catch_warnings(record=True) as caught:
        yield
    for w in caught:
        if not any(issubclass(w.category, c) and f in str(w.message) for c, f, _why in QUIET_WARNINGS):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
