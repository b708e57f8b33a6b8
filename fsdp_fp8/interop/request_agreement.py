"""One request, agreed: the ranks that share a request (a CFG pair, a sequence group, or both)
compare its fingerprint before its first forward.

Under CFG-parallel or Ulysses the ranks of one request each call the pipeline and are trusted to
pass it the same request. A rank given another prompt, seed, size or step count does not fail by
itself: the two latents blend silently, or one rank runs a step its partner does not and the next
collective hangs or aborts on a size mismatch (gloo's "Received data size doesn't match"). So the
pipeline ``load_pipeline`` returns under such a layout is of one subclass of ours
(``Agreeing<Class>``, made once per class, as ``fully_shard`` makes ``FSDP<Class>``) whose
``__call__`` first fingerprints the call and exchanges the fingerprints over the gloo agreement
group (``fsdp_fp8.collective.exchange``):

- every argument of the pipeline's ``__call__``, defaults applied, is one field; each field is a
  16-byte BLAKE2b digest of its value (text, numbers, tensors' and images' bytes, a generator's
  state: its seed) and a short form for messages (``SHOWN`` bytes), so every rank sends the same
  number of bytes, before any collective whose size depends on the request;
- the arguments that only say what this rank hands back (``LOCAL``: the output type, the step
  callback) are not compared: a CFG pair's second rank asks for latents only;
- a difference in any request is one ``RequestMismatchError`` on every rank of the world (each
  rank sees every fingerprint), naming each field that differs and the ranks on each side, raised
  before any step runs: no rank goes on into a collective its peers never reach.
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


def agree_on_request(teams: RequestTeams, fields: dict) -> None:
    """Exchange this rank's fingerprint with every rank; ``RequestMismatchError`` on every rank
    when the ranks of any request differ (collective)."""
    names = sorted(fields)
    prints = exchange(
        fingerprint(fields),
        timeout_s=teams.timeout_s,
        stage="agreement on the request",
        context="before the pipeline's first step",
        before_changes=True,
    )
    problems = mismatch_problems(names, prints, teams)
    if problems:
        raise RequestMismatchError(problems)


# The request teams of a pipeline from ``load_pipeline`` under CFG-parallel or Ulysses
# (docs/design.md, "State kept on other libraries' objects").
REQUEST_TEAMS: Attachment[RequestTeams] = Attachment("the request teams of a pipeline")
_AGREEING: dict[type, type] = {}  # a pipeline class -> its one subclass of ours


def agreeing_class(cls: type) -> type:
    """``cls`` whose ``__call__`` agrees on the request first; one subclass per class, made once."""
    if cls not in _AGREEING:
        signature = inspect.signature(cls.__call__)

        class Agreeing(cls):
            def __call__(self, *args, **kwargs):
                teams = REQUEST_TEAMS.get(self)
                if teams is not None:
                    agree_on_request(teams, request_fields(signature, self, args, kwargs))
                return super().__call__(*args, **kwargs)

        Agreeing.__name__ = Agreeing.__qualname__ = f"Agreeing{cls.__name__}"
        _AGREEING[cls] = Agreeing
    return _AGREEING[cls]


def attach_request_agreement(pipe, teams: RequestTeams) -> None:
    """Make every call of ``pipe`` agree on its request among ``teams`` first."""
    REQUEST_TEAMS.set(pipe, teams)
    pipe.__class__ = agreeing_class(type(pipe))


def library_class(pipe) -> type:
    """The pipeline's own class (diffusers'), under the subclass of ours."""
    return next(c for c in type(pipe).__mro__ if c not in _AGREEING.values())


__all__ = [
    "RequestMismatchError",
    "RequestTeams",
    "agree_on_request",
    "attach_request_agreement",
    "fingerprint",
    "library_class",
    "mismatch_problems",
    "request_fields",
    "request_teams",
]
