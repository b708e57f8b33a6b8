"""What the commands run: the launcher (``runner``), ``python -m fsdp_fp8`` (``commands``),
the embedded demo and the clean exit. The application layer: it may quiet other libraries'
import-time noise, which the library itself never does."""

import logging as _logging


class _ImportNoise(_logging.Filter):
    """TorchAO 0.18 warns on import that its optional CUDA kernels (mxfp8, cutlass) do not
    load on a CPU build, and torch warns about its Enum registration; fsdp_fp8 uses neither,
    so every rank printing them only hides real messages."""

    def filter(self, record: _logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith("Failed to load") and "torchao/_C" in msg) and (
            "is an Enum subclass and is now natively supported" not in msg
        )


for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).addFilter(_ImportNoise())
