"""Writing ModelOpt-layout static-FP8 checkpoints."""
