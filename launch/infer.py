"""torchrun entry point: load a ModelOpt static-FP8 checkpoint sharded over the ranks and sample.

    torchrun --nproc-per-node 2 launch/infer.py            # the embedded demo
    torchrun --nproc-per-node 8 launch/infer.py --checkpoint DIR --steps 50

Everything happens in fsdp_fp8.cli.runner; see docs/usage.md.
"""

from fsdp_fp8.cli.runner import main
from fsdp_fp8.cli.shutdown import shutdown_distributed

if __name__ == "__main__":
    try:
        code = main()
    except BaseException:
        shutdown_distributed()  # keep the traceback and Python's own exit status
        raise
    # Leaves through os._exit after flushing: gloo + FSDP2 can abort during interpreter
    # finalization after a correct run (docs/shutdown.md).
    shutdown_distributed(code)
