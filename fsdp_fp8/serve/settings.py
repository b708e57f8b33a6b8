"""The server's own options, declared once as fields (``generation.declare``), beside the
launcher's layout options it shares (``SHARED``: the same declarations as the launcher's).
No torch here: ``serve --help`` and a usage error answer before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_fp8.generation.declare import EVERY, option
from fsdp_fp8.generation.values import RUN_SETTINGS_TO_AGREE

SERVING = "serving"
# The launcher's options a server takes as they are: the checkpoint and what every rank must be
# given alike (fsdp_fp8.generation.values.RunSettings)
SHARED = ("checkpoint", *RUN_SETTINGS_TO_AGREE)
MAX_UPLOAD_BYTES = 64 << 20  # an input_reference, at most (an image or a short clip)
LOOPBACK = ("127.0.0.1", "localhost", "::1")  # addresses only this machine reaches
MIN_KEY_CHARACTERS = 16


@dataclass(frozen=True)
class ServeSettings:
    """Where the server listens, where it keeps results, how much it admits."""

    host: str = option("127.0.0.1", "the address to listen on (default 127.0.0.1: this machine only; another "
                       "address needs --api-key-file)", SERVING, EVERY)  # fmt: skip
    port: int = option(8000, "the port to listen on (default 8000; 0: any free port, printed at start)", SERVING,
                       EVERY, bound=(0, 65_535), type=int)  # fmt: skip
    output_dir: str = option("fsdp_fp8-videos", "where finished videos and every job's record (JSON) are kept; "
                             "records found there at start are served again (default ./fsdp_fp8-videos)", SERVING,
                             EVERY, metavar="DIR")  # fmt: skip
    max_queue: int = option(16, "jobs waiting at most; past it POST /v1/videos answers 429 with Retry-After "
                            "(default 16)", SERVING, EVERY, bound=(1, 100_000), type=int, metavar="Q")  # fmt: skip
    api_key_file: str | None = option(None, "a file holding the API key: every route but /health then needs "
                                      "Authorization: Bearer KEY", SERVING, EVERY, metavar="F")  # fmt: skip
    max_upload_bytes: int = option(MAX_UPLOAD_BYTES, "the largest request body (an input_reference upload "
                                   "included) in bytes (default 64 MiB)", SERVING, EVERY,
                                   bound=(1_024, 1 << 40), type=int, metavar="BYTES")  # fmt: skip
    drain_s: float = option(30.0, "on SIGTERM: seconds the running jobs may take to finish before they are "
                            "cancelled (default 30)", SERVING, EVERY, bound=(0.0, 86_400.0), type=float,
                            metavar="S")  # fmt: skip


__all__ = ["LOOPBACK", "MAX_UPLOAD_BYTES", "MIN_KEY_CHARACTERS", "SHARED", "ServeSettings"]
