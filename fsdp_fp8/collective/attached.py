"""What fsdp_fp8 remembers about objects it did not create (modules, models, pipelines): the one
kind of map every such record is (``Attachment``). docs/design.md "State kept on other libraries'
objects" lists every attachment and the module that declares it (the module that owns its value).

fsdp_fp8 sets no attribute of its own on another library's object: an attribute could
collide with the library's own names (``cache_context`` did, shadowing diffusers' method),
would travel with ``copy``/``pickle``, and is invisible to a reader of the code that reads
it back. Each kind of state is one :class:`Attachment` instead: a map from the object, by
identity and held weakly, to the value. The value lives exactly as long as its object; when
the object is freed its entry goes with it. A value must not refer back to its object (the
map holds the value strongly, so that object could never be freed).
"""

from __future__ import annotations

import threading
import weakref
from typing import Generic, TypeVar

V = TypeVar("V")


class Attachment(Generic[V]):
    """One kind of state kept about other objects: ``set(owner, value)``, ``get(owner)``.

    Keyed by identity (``id``, checked against a weak reference), not by ``==``/``hash``: a
    class that defines equality, or none, is still a key, and two equal objects keep their own
    values. The entry is dropped when its owner is freed.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._entries: dict[int, tuple[weakref.ref, V]] = {}
        self._lock = threading.Lock()  # a weak reference's callback may run on any thread

    def set(self, owner: object, value: V) -> None:
        key = id(owner)

        def forget(ref: weakref.ref) -> None:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and entry[0] is ref:  # not a newer object at the same id
                    del self._entries[key]

        ref = weakref.ref(owner, forget)
        with self._lock:
            self._entries[key] = (ref, value)

    def get(self, owner: object) -> V | None:
        """The value set for ``owner``, or ``None``."""
        entry = self._entries.get(id(owner))
        if entry is None or entry[0]() is not owner:
            return None
        return entry[1]

    def __len__(self) -> int:
        """How many live owners hold a value (what a test of the weak hold counts)."""
        return sum(1 for ref, _ in list(self._entries.values()) if ref() is not None)

    def __repr__(self) -> str:
        return f"Attachment({self.what!r}, {len(self)} owners)"
