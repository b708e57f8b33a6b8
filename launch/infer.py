"""torchrun entry point: load a ModelOpt static-FP8 checkpoint sharded over the ranks and sample.

    torchrun --nproc-per-node 2 launch/infer.py            # the embedded demo
    torchrun --nproc-per-node 8 launch/infer.py --checkpoint DIR --steps 50
    python launch/infer.py --nproc-per-node 8 --checkpoint DIR   # starts the 8 ranks itself

The same as ``torchrun ... -m fsdp_fp8 run`` (an installed package needs no checkout);
everything happens in fsdp_fp8.cli.runner, see docs/usage.md.
"""

import sys

from fsdp_fp8.cli.commands import main

if __name__ == "__main__":
    # Never returns: run leaves through os._exit after flushing, because gloo + FSDP2 can
    # abort during interpreter finalization after a correct run (docs/shutdown.md).
    sys.exit(main(["run", *sys.argv[1:]], prog="launch/infer.py"))
