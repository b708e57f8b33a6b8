"""The way back: a loaded (sharded) model written as a checkpoint, or gathered onto rank 0.

``plan_save`` (``plan``: what a rank writes, pure), the save's temporary directory and its
leftovers (``temp_dir``), the destination check (``destination``), the source's non-weight files
(``source_files``), a rank's writes (``write``), ``save_checkpoint`` (``save_checkpoint``: the
pipeline) and
``gather_state_dict`` (``gather``). Imports errors, format, collective, fp8, load, models, export.
"""
