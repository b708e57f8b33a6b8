"""``python -m fsdp_fp8 run|inspect|verify``; ``torchrun --nproc-per-node N -m fsdp_fp8 run``."""

import sys

from fsdp_fp8.cli.commands import main

sys.exit(main(prog="python -m fsdp_fp8"))
