"""How a load reads: one frozen value handed down from ``load_model`` / ``load_pipeline`` to the
reader, the staging ring and the prefetch (torchao's ``Float8LinearConfig`` pattern). Nothing
here is read at call time from a module global: a caller who wants other settings passes
``ReadOptions(...)``, and two loads in one process may use different ones.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from fsdp_fp8.errors import ArgumentError

ALL_ROWS = 1 << 62  # a prefetch budget meaning "every row this rank reads"
# Host memory one copy between an accelerator and the files goes through: the load's staging ring
# (``ReadOptions.staging_bytes``) and a save's copies out of accelerator memory alike.
DEFAULT_STAGING_BYTES = 64 << 20


@dataclass(frozen=True)
class ReadOptions:
    """Settings of one load's reads.

    - ``threads``: reader workers; ``preadv`` releases the GIL, so they overlap on storage and cores.
    - ``request_bytes``: the largest single ``preadv`` into host storage.
    - ``in_flight``: requests submitted and not yet finished.
    - ``staging_bytes``: host memory reads into accelerator memory go through (one ring of
      ``fsdp_fp8.format.staging.STAGING_SLOTS`` slots, allocated once per load); CPU storage is
      read into directly.
    - ``prefetch_bytes``: bytes of this rank's rows hinted to the page cache
      (``POSIX_FADV_WILLNEED``) while the model is set up; ``0`` turns it off, ``ALL_ROWS`` (the
      default) hints every row the rank reads. Capped at the rank's share of half the available
      memory (``fsdp_fp8.load.prefetch.prefetch_budget``).
    """

    threads: int = 4
    request_bytes: int = 8 << 20
    in_flight: int = 8
    staging_bytes: int = DEFAULT_STAGING_BYTES
    prefetch_bytes: int = ALL_ROWS

    def __post_init__(self):
        problems = [
            f"ReadOptions.{f.name} must be an int >= {0 if f.name == 'prefetch_bytes' else 1}, got {getattr(self, f.name)!r}"
            for f in fields(self)
            if not isinstance(getattr(self, f.name), int)
            or getattr(self, f.name) < (0 if f.name == "prefetch_bytes" else 1)
        ]
        if problems:
            raise ArgumentError(problems, "ReadOptions")


DEFAULT_READ_OPTIONS = ReadOptions()
