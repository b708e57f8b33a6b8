"""Third-party messages that never concern a user of the launcher or the CLI, silenced by name
for the whole process (``fsdp_fp8.third_party.QUIET``: each entry one message, matched by the
logger that emits it and a fragment of its text; nothing else those loggers say is touched).

An application may quiet other libraries for its process; the library quiets only their
import-time messages, and only around its own imports (``fsdp_fp8.third_party.quiet_imports``).
docs/usage.md lists them.
"""

from __future__ import annotations

import logging

from fsdp_fp8.third_party import QuietFilter, fragments_by_logger


def quiet_third_party() -> None:
    """Attach the filters (once per process): call before the libraries are imported."""
    for name, fragments in fragments_by_logger().items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietFilter) for f in logger.filters):
            logger.addFilter(QuietFilter(fragments))
