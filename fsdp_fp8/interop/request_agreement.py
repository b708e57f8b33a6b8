"""One request, agreed: each call of a pipeline from ``load_pipeline`` is one request, whose ranks
meet once, before its first transformer forward.

``attach_request_gate`` gives the pipeline one subclass of ours (made once per class, keeping the
class's name). Its ``__call__`` opens a request on the :class:`RequestGate`: a new serial and,
when a request spans several ranks, a fingerprint of every argument. The meeting is one exchange
over the gloo agreement group (``fsdp_fp8.collective.exchange``).

Ranks given different requests raise one ``RequestMismatchError`` each, naming the fields. A rank
whose call failed before its first forward brings its error: every rank raises ``RequestAbortedError``.

Reliability: docs/reliability.md, "The ranks of one request agree on it".
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from dataclasses import dataclass

import torch

from fsdp_fp8.collective import exchange, ranks_label
from fsdp_fp8.collective.attached import Attachment
from fsdp_fp8.errors import ProblemsError

# What a rank hands back, not what it computes: may differ between the ranks of one request.
LOCAL = frozenset({"self", "output_type", "return_dict", "callback_on_step_end", "callback_on_step_end_tensor_inputs"})
DIGEST_BYTES = 16
SHOWN_BYTES = 48  # a field's short form in a message, at most (UTF-8, cut at a character)


class RequestMismatchError(ProblemsError, ValueError):
    """The ranks of one request were given different requests; nothing ran."""

    default_context = "the ranks that share one request were given different requests; no step ran"


@dataclass(frozen=True)
class RequestTeams:
    """The ranks of every request slot of the world (each rank's team among them) and how long
    a rank waits for the others' fingerprints."""

    teams: tuple[tuple[int, ...], ...]
    timeout_s: float


def request_teams(world: int, team: int, timeout_s: float) -> RequestTeams:
    """Consecutive blocks of ``team`` ranks: a slot's sequence groups and CFG roles are
    contiguous (``runtime.parallel_layout``: ``rank = (slot x cfg + role) x sp + position``)."""
    return RequestTeams(tuple(tuple(range(s, s + team)) for s in range(0, world, team)), timeout_s)


def _feed(h, value) -> None:
    """Feed ``value``'s content, tagged by kind, into ``h``; the same content on any rank gives
    the same bytes (numbers by value: ``3`` and ``3.0`` guide alike)."""
    if value is None or isinstance(value, bool | str):
        h.update(f"{type(value).__name__}:{value}\0".encode("utf-8", "surrogatepass"))
    elif isinstance(value, int | float):
        h.update(f"num:{float(value).hex()}\0".encode())
    elif isinstance(value, list | tuple):
        h.update(f"seq:{len(value)}\0".encode())
        for item in value:
            _feed(h, item)
    elif isinstance(value, dict):
        h.update(f"map:{len(value)}\0".encode())
        for key in sorted(value, key=str):
            _feed(h, str(key))
            _feed(h, value[key])
    elif isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        h.update(f"tensor:{t.dtype}:{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, torch.Generator):
        h.update(f"generator:{value.device.type}\0".encode())
        h.update(value.get_state().numpy().tobytes())
    else:
        _feed_other(h, value)


def _feed_other(h, value) -> None:
    """Images and arrays by their pixels, dataclasses by their fields, anything else by its type."""
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    if hasattr(value, "tobytes") and hasattr(value, "size"):  # a PIL image or a numpy array
        shape = getattr(value, "shape", value.size)
        h.update(f"{name}:{getattr(value, 'mode', '')}:{getattr(value, 'dtype', '')}:{shape}\0".encode())
        h.update(value.tobytes())
    elif dataclasses.is_dataclass(value):
        h.update(f"{name}\0".encode())
        _feed(h, {f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    else:
        h.update(f"{name}\0".encode())


def _shown(value) -> str:
    """A short form of ``value`` for a message."""
    if isinstance(value, torch.Tensor):
        return f"a {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')} tensor"
    if isinstance(value, torch.Generator):
        return f"a generator seeded {value.initial_seed()}"
    if hasattr(value, "tobytes") and hasattr(value, "size") and hasattr(value, "mode"):
        return f"a {value.size[0]}x{value.size[1]} {value.mode} image"
    if isinstance(value, list | tuple) and value and not isinstance(value[0], int | float | str):
        return f"{len(value)} x {_shown(value[0])}"
    return repr(value)


def _field(value) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    _feed(h, value)
    shown = _shown(value).encode("utf-8", "surrogatepass")
    if len(shown) > SHOWN_BYTES:
        shown = shown[: SHOWN_BYTES - 3].decode("utf-8", "ignore").encode() + b"..."
    return h.digest() + shown.ljust(SHOWN_BYTES, b"\0")


def request_fields(signature: inspect.Signature, pipe, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name, defaults applied, less ``LOCAL``."""
    bound = signature.bind(pipe, *args, **kwargs)
    bound.apply_defaults()
    return {name: value for name, value in bound.arguments.items() if name not in LOCAL}


def fingerprint(fields: dict) -> bytes:
    """Every field's digest and short form: ``len(fields) x (DIGEST_BYTES + SHOWN_BYTES)`` bytes."""
    return b"".join(_field(fields[name]) for name in sorted(fields))


def _short(part: bytes) -> str:
    return part[DIGEST_BYTES:].rstrip(b"\0").decode("utf-8", "replace")


def mismatch_problems(names: list[str], prints: list[bytes], teams: RequestTeams) -> list[str]:
    """One problem per field that differs between the ranks of one request, naming both sides."""
    size, world = DIGEST_BYTES + SHOWN_BYTES, len(prints)
    problems = []
    for team in teams.teams:
        if len({prints[r] for r in team}) == 1:
            continue
        for i, name in enumerate(names):
            sides: dict[bytes, list[int]] = {}
            for r in team:
                sides.setdefault(prints[r][i * size : (i + 1) * size], []).append(r)
            if len(sides) > 1:
                each = "; ".join(f"{ranks_label(ranks, world)}: {_short(part)}" for part, ranks in sides.items())
                problems.append(f"`{name}` differs within the request of ranks {', '.join(map(str, team))} ({each})")
    return problems


class RequestAbortedError(ProblemsError, RuntimeError):
    """A rank's request failed before its first forward; every rank stopped before any step."""

    default_context = "a rank's request failed before its first step; no rank ran a step of it"


@dataclass
class RequestGate:
    """The requests of one pipeline: the serial of the call running (new per call), its
    fingerprint, and whether its ranks have met. ``teams`` is None in one process (nothing to
    meet); ``compares``: the ranks of a request are several, so their calls are fingerprinted."""

    teams: RequestTeams | None
    compares: bool = False
    serial: int = 0
    met: bool = True  # no request open, or its ranks have met
    aborted: bool = False  # a rank's request failed before the first forward: none went on
    names: list[str] = dataclasses.field(default_factory=list)
    print_: bytes = b""

    def begin(self, fields: dict | None) -> None:
        """A new request: its serial, and its fingerprint when the ranks of a request compare."""
        self.serial += 1
        self.met, self.aborted = False, False
        self.names = sorted(fields) if fields is not None else []
        self.print_ = fingerprint(fields) if fields is not None else b""

    def meet(self, failure: str | None = None) -> list[tuple[int, str]]:
        """The ranks' one meeting of this request (collective; once per request): ``failure`` is
        this rank's error, if its request failed before its first forward. A well rank raises
        ``RequestAbortedError`` when a peer failed, ``RequestMismatchError`` when the ranks of a
        request differ; a failed rank gets every failure back (``(rank, message)``)."""
        if self.met or self.teams is None:
            self.met = True
            self.aborted = self.aborted or failure is not None
            return [(0, failure)] if failure is not None else []
        self.met = True
        met = exchange(
            (failure, self.print_),
            timeout_s=self.teams.timeout_s,
            stage="meeting before the request's first forward",
            context="before the pipeline's first step",
            before_changes=True,
        )
        failures = [(rank, message) for rank, (message, _) in enumerate(met) if message is not None]
        self.aborted = bool(failures)
        if failure is not None:
            return failures
        if failures:
            world = len(met)
            raise RequestAbortedError([f"{ranks_label([rank], world)}: {message}" for rank, message in failures])
        if self.compares and (problems := mismatch_problems(self.names, [p for _, p in met], self.teams)):
            raise RequestMismatchError(problems)
        return []

    def fail(self, failure: str) -> list[tuple[int, str]]:
        """This rank's request failed before it could call the pipeline: open it and meet with
        ``failure`` (collective, as ``meet``)."""
        self.begin(None)
        return self.meet(failure)


# The request gate of a pipeline from ``load_pipeline`` (docs/design.md, "State kept on other
# libraries' objects").
REQUEST_GATE: Attachment[RequestGate] = Attachment("the request gate of a pipeline")
_AGREEING: dict[type, type] = {}  # a pipeline class -> its one subclass of ours


def agreeing_class(cls: type) -> type:
    """``cls`` whose ``__call__`` opens a request on the pipeline's gate (and meets its peers with
    its error if it fails before the first forward); one subclass per class, made once."""
    if cls not in _AGREEING:
        signature = inspect.signature(cls.__call__)

        class Agreeing(cls):
            def __call__(self, *args, **kwargs):
                gate = REQUEST_GATE.get(self)
                if gate is None:
                    return super().__call__(*args, **kwargs)
                gate.begin(request_fields(signature, self, args, kwargs) if gate.compares else None)
                try:
                    return super().__call__(*args, **kwargs)
                except Exception as exc:
                    if not gate.met:  # failed before the first forward: the peers learn it now
                        gate.meet(f"{type(exc).__name__}: {exc}")
                    raise

        # the user's class name, as printed by ``type(pipe).__name__`` and diffusers' messages
        Agreeing.__name__, Agreeing.__qualname__ = cls.__name__, cls.__qualname__
        _AGREEING[cls] = Agreeing
    return _AGREEING[cls]


def attach_request_gate(pipe, gate: RequestGate) -> None:
    """Make every call of ``pipe`` one request of ``gate``."""
    REQUEST_GATE.set(pipe, gate)
    pipe.__class__ = agreeing_class(type(pipe))


def request_gate(pipe) -> RequestGate | None:
    """The gate of a pipeline from ``load_pipeline`` (None for any other)."""
    return REQUEST_GATE.get(pipe)


def library_class(pipe) -> type:
    """The pipeline's own class (diffusers'), under the subclass of ours."""
    return next(c for c in type(pipe).__mro__ if c not in _AGREEING.values())


__all__ = [
    "RequestAbortedError",
    "RequestGate",
    "RequestMismatchError",
    "RequestTeams",
    "attach_request_gate",
    "fingerprint",
    "library_class",
    "mismatch_problems",
    "request_fields",
    "request_gate",
    "request_teams",
]
