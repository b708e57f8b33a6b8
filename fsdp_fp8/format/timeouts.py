"""How long a rank may wait for its peers: the one bound every timeout is checked against (the
launcher's and ``save``'s ``--timeout``, ``LoadOptions.timeout_s``). Imports nothing: the
launcher checks its options before torch loads."""

from __future__ import annotations

# A day: beyond it a number is a typo, and timedelta / gloo's millisecond timeouts overflow on far
# larger ones (1e300, inf).
MAX_TIMEOUT_S = 86_400.0


def timeout_problems(timeout: object, name: str = "--timeout") -> list[str]:
    """Why ``timeout`` cannot be a wait in seconds: it must be a finite number above 0 and at most
    ``MAX_TIMEOUT_S`` (empty: it can; ``None`` is no timeout given)."""
    if timeout is None:
        return []
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        return [f"{name} must be a number of seconds, got {timeout!r}"]
    if not timeout > 0:  # NaN too
        return [f"{name} must be > 0, got {timeout}"]
    if not timeout <= MAX_TIMEOUT_S:  # inf too
        return [f"{name} must be <= {MAX_TIMEOUT_S:,.0f} seconds (a day), got {timeout:g}"]
    return []
