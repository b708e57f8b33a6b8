"""The gloo side group every agreement runs on, and one exchange over it.

The exchanges run on a gloo side group, created once per default process group, never on the
default group itself: with NCCL, torchrun's async error handling makes the watchdog kill a
process whose collective waits too long, instead of letting it raise. The side group has its
own timeout; each rank marks its arrival in the default store first, so a rank that gives up
names the ranks that never arrived, and a rank arriving after a peer gave up raises at once
instead of waiting a whole timeout. Any failure of the exchange is a ``PeerLostError`` naming
the ranks, the stage and the timeout.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from datetime import timedelta

import torch.distributed as dist

from fsdp_fp8.errors import PeerLostError

log = logging.getLogger(__name__)

# How long the gloo group may take to connect once every rank has arrived: a connection that
# takes longer is a network problem (the wrong interface), not a late peer.
CONNECT_TIMEOUT_S = 60.0

_side: dict = {}  # "group", "world" (the default group it belongs to), "sequence", "created"
_created = [0]  # side groups this process created: the same count on every rank
_attempts = [0]  # side-group creations begun: the same count on every rank


def distributed() -> bool:
    """A process group of more than one rank is up: agreements are collective."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world() -> tuple[int, int]:
    """(this rank, world size); (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - without a store the error cannot name the late rank
        return None


def gloo_interface(env) -> tuple[str | None, str | None]:
    """(value to give ``GLOO_SOCKET_IFNAME``, or None; a warning, or None) from ``env``.

    gloo picks its interface from the hostname unless ``GLOO_SOCKET_IFNAME`` names one; on
    clusters that set only ``NCCL_SOCKET_IFNAME`` the hostname's address may not reach the other
    nodes. NCCL's value is taken when gloo can read it: a list of names (``eth0,eth1``; a leading
    ``=`` is NCCL's "exact match"), not an exclusion (``^docker0,lo``), which gloo has no syntax for.
    """
    if env.get("GLOO_SOCKET_IFNAME") or not env.get("NCCL_SOCKET_IFNAME"):
        return None, None
    nccl = env["NCCL_SOCKET_IFNAME"].strip()
    if nccl.startswith("^"):
        return None, (
            f"NCCL_SOCKET_IFNAME={nccl!r} excludes interfaces, which gloo cannot; the agreement group "
            "picks its interface from the hostname: set GLOO_SOCKET_IFNAME if that address does not "
            "reach the other nodes"
        )
    return nccl.lstrip("="), None


def _default_gloo_interface() -> None:
    value, warning = gloo_interface(os.environ)
    if warning:
        log.warning("%s", warning)
    if value:
        os.environ["GLOO_SOCKET_IFNAME"] = value  # read by gloo when the group's device is made


def _wait_for_everyone(timeout_s: float, context: str) -> None:
    """Every rank marks its arrival at the side group's creation in the default store and waits
    for the others: a late or dead peer is named here, before gloo tries to connect."""
    store, rank, world = _store(), dist.get_rank(), dist.get_world_size()
    if store is None:
        return
    _attempts[0] += 1
    prefix = f"fsdp_fp8/side_group/{_attempts[0]}"
    try:
        store.set(f"{prefix}/{rank}", "1")
        store.wait([f"{prefix}/{r}" for r in range(world)], timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - a timeout: name who is missing
        missing = [r for r in range(world) if not _check(store, f"{prefix}/{r}")]
        raise PeerLostError(
            f"{context}rank {rank} could not set up the agreement group: rank(s) {missing or '?'} did not "
            f"arrive within {timeout_s:g} s (the agreement timeout; a peer is late, died or failed); "
            f"nothing was changed: {type(exc).__name__}: {exc}"
        ) from exc


def side_group(timeout_s: float, context: str = ""):
    """The gloo group the agreements run on (collective the first time, like ``new_group``).

    Made in two steps: every rank arrives (a peer that does not come within ``timeout_s`` is a
    ``PeerLostError`` naming it), then gloo connects within ``CONNECT_TIMEOUT_S`` (a failure
    then is the network: the error says which variable picks the interface).
    ``GLOO_SOCKET_IFNAME`` defaults to ``NCCL_SOCKET_IFNAME`` when only that is set."""
    world = dist.group.WORLD
    if _side.get("world") is not world:
        _side.clear()
        context = f"{context}: " if context else ""
        _default_gloo_interface()
        _wait_for_everyone(timeout_s, context)
        connect_s = min(timeout_s, CONNECT_TIMEOUT_S)
        try:
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=connect_s))
        except Exception as exc:
            raise PeerLostError(
                f"{context}rank {dist.get_rank()} could not connect the gloo agreement group within "
                f"{connect_s:g} s although every rank arrived: the network interface gloo uses "
                f"(GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME', '(unset: from the hostname)')}) "
                f"may not reach the other ranks; set GLOO_SOCKET_IFNAME to an interface that does (or "
                f"NCCL_SOCKET_IFNAME alone, which fsdp_fp8 copies); nothing was changed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        _created[0] += 1
        _side.update(group=group, world=world, sequence=itertools.count(), created=_created[0])
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is not None:  # present in every torch this package supports (>= 2.10)
        set_timeout(timedelta(seconds=timeout_s), _side["group"])
    return _side["group"]


def _check(store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001
        return False


def _quiet(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        pass


def _arrive(store, prefix: str, rank: int):
    """Mark this rank's arrival; the store, or ``None`` when it cannot be written."""
    if store is None:
        return None
    try:
        store.set(f"{prefix}/arrived/{rank}", "1")
    except Exception:  # noqa: BLE001 - the exchange itself will tell
        return None
    return store


def _who_failed(store, prefix: str, rank: int, world: int, waited: float, timeout_s: float) -> str:
    """Which peers a failed exchange was missing, from the arrival marks in the store."""
    missing = []
    if store is not None:
        _quiet(store.set, f"{prefix}/gave_up/{rank}", "1")
        missing = [r for r in range(world) if not _check(store, f"{prefix}/arrived/{r}")]
    if missing and waited >= 0.9 * timeout_s:
        return f"rank(s) {missing} did not arrive within {timeout_s:g} s (the agreement timeout)"
    if missing:
        return f"rank(s) {missing} left before arriving (died or failed) after {waited:.1f} s"
    return f"a peer died or failed during it after {waited:.1f} s (agreement timeout {timeout_s:g} s)"


def exchange(obj, *, timeout_s: float, stage: str, context: str, before_changes: bool = False) -> list:
    """Every rank's ``obj``, in rank order, through the side group; or a ``PeerLostError``
    (``before_changes``: it says that nothing was changed)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    context = f"{context}: " if context else ""
    nothing = "nothing was changed; " if before_changes else ""
    group = side_group(timeout_s, context.rstrip(": "))
    # The group's name is the same on every rank and new for every group: markers of an
    # earlier group (the store outlives it) are never mistaken for this one's.
    prefix = f"fsdp_fp8/agreement/{getattr(group, 'group_name', '')}/{_side['created']}/{next(_side['sequence'])}"
    store = _arrive(_store(), prefix, rank)
    gave_up = [r for r in range(world) if r != rank and store is not None and _check(store, f"{prefix}/gave_up/{r}")]
    if gave_up:
        _side.clear()
        raise PeerLostError(
            f"{context}rank {rank} arrived at the {stage} after rank(s) {gave_up} had given up "
            f"waiting for it (agreement timeout {timeout_s:g} s); {nothing}stopping here"
        )
    out: list = [None] * world
    t0 = time.monotonic()
    try:
        dist.all_gather_object(out, obj, group=group)
    except Exception as exc:  # a peer died, failed, or did not arrive within the timeout
        _side.clear()  # a group left mid-collective is not reused
        who = _who_failed(store, prefix, rank, world, time.monotonic() - t0, timeout_s)
        raise PeerLostError(
            f"{context}rank {rank} could not complete the {stage} with the other ranks: {who}; "
            f"{nothing}{type(exc).__name__}: {exc}"
        ) from exc
    return out
