"""How a load reads: one frozen value handed down from ``load_model`` / ``load_pipeline`` to the
reader, the staging ring and the prefetch (torchao's ``Float8LinearConfig`` pattern). Nothing
here is read at call time from a module global: a caller who wants other settings passes
``ReadOptions(...)``, and two loads in one process may use different ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_fp8.errors import ArgumentError

ALL_ROWS = 1 << 62  # a prefetch budget meaning "every row this rank reads"
# Host memory one copy between an accelerator and the files goes through: the load's staging ring
# (``ReadOptions.staging_bytes``) and a save's copies out of accelerator memory alike.
DEFAULT_STAGING_BYTES = 64 << 20


@dataclass(frozen=True)
class ReadOptions:
    """Settings of one load's reads.

    - ``direct``: read with ``O_DIRECT`` (past the page cache, ``fsdp_fp8.reading.direct_io``).
      ``None`` (the default): where every file the rank reads takes it and the rank's rows are not
      already in the page cache; ``True``: always (a file system that refuses it is refused before
      any read); ``False``: never.
    - ``threads``: reader workers; ``preadv`` releases the GIL, so they overlap on storage and cores.
      ``None``: chosen from the device the files are on (``fsdp_fp8.reading.read_choice``).
    - ``request_bytes``: the largest single ``preadv`` into host storage; ``None``: chosen as ``threads``.
    - ``in_flight``: requests submitted and not yet finished.
    - ``staging_bytes``: host memory reads into accelerator memory go through (one ring of
      ``fsdp_fp8.reading.staging.STAGING_SLOTS`` slots, allocated once per load); CPU storage is
      read into directly.
    - ``prefetch_bytes``: bytes of this rank's rows hinted to the page cache
      (``POSIX_FADV_WILLNEED``) while the model is set up; ``0`` turns it off, ``ALL_ROWS`` (the
      default) hints every row the rank reads. Capped at the rank's share of half the available
      memory (``fsdp_fp8.reading.prefetch.prefetch_budget``). Reads through the page cache only: an
      O_DIRECT load hints nothing (it would not use what the hints fetch).
    """

    direct: bool | None = None
    threads: int | None = None
    request_bytes: int | None = None
    in_flight: int = 8
    staging_bytes: int = DEFAULT_STAGING_BYTES
    prefetch_bytes: int = ALL_ROWS

    def __post_init__(self):
        problems = (
            []
            if self.direct in (None, True, False)
            else [f"ReadOptions.direct must be None, True or False, got {self.direct!r}"]
        )
        for name, least, optional in _SIZES:
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                problems.append(
                    f"ReadOptions.{name} must be an int >= {least}{' or None' if optional else ''}, got {value!r}"
                )
        if problems:
            raise ArgumentError(problems, "ReadOptions")

    @property
    def resolved(self) -> bool:
        """Whether nothing is left to choose (``read_choice.choose_reads`` returns such a value)."""
        return None not in (self.direct, self.threads, self.request_bytes)


_SIZES = (  # (field, least value, may be None: chosen at load time)
    ("threads", 1, True),
    ("request_bytes", 1, True),
    ("in_flight", 1, False),
    ("staging_bytes", 1, False),
    ("prefetch_bytes", 0, False),
)


DEFAULT_READ_OPTIONS = ReadOptions()
