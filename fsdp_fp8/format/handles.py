"""Open each checkpoint file once, without blocking, and hold it from validation to the last read.

Why a held descriptor and not a path: a shard replaced (rename, re-sync) or rewritten between
the checks and the reads would otherwise load bytes nobody checked, and ranks could end up
holding different weights. An ``OpenFile`` pins the inode that was validated; every read is a
``pread`` on that descriptor (thread-safe, so a parallel reader can share it), and
``changes()`` tells whether the file was rewritten in place (its size or mtime moved) or the
path now names another file. What this does and does not guarantee is in docs/reliability.md.

Opening never blocks and never reads without bound: ``O_NONBLOCK`` makes ``open()`` of a
named pipe return at once, ``fstat`` then refuses anything that is not a regular file (pipe,
device, socket, directory), and a JSON file is read only up to ``MAX_JSON_BYTES``.
"""

from __future__ import annotations

import errno
import json
import os
import reprlib
import stat
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

from fsdp_fp8.errors import ArgumentError

# Configs and indexes of the largest public checkpoints are a few MB (an index lists every
# tensor once); anything far larger is corrupt or hostile, and json.loads would hold it all.
MAX_JSON_BYTES = 64 * 1024 * 1024
# Real configs nest a handful of levels (config -> quantization_config -> config_groups -> group
# -> weights -> field). Deeper input would end in a RecursionError in a parser, a repr or a
# library that walks configs.
MAX_JSON_DEPTH = 32

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 80
_short.maxlevel = 3


def short_repr(value: object) -> str:
    """``repr`` bounded in length and depth: safe for any value parsed from a file."""
    return _short.repr(value)


@dataclass(frozen=True)
class FileIdentity:
    """What says "the same file, unchanged": device, inode, size and mtime (ns)."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def differences(self, other: FileIdentity) -> list[str]:
        return [
            f"{field} {getattr(self, field)} -> {getattr(other, field)}"
            for field in ("device", "inode", "size", "mtime_ns")
            if getattr(self, field) != getattr(other, field)
        ]


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


class OpenFile:
    """One regular file, opened once; read with ``pread``; closed by ``close()`` or when collected."""

    def __init__(self, path: Path, name: str, fd: int, identity: FileIdentity):
        self.path, self.name, self.identity = path, name, identity
        self._fd: int | None = fd
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, os.close, fd)
        self._direct: int | None = None  # a second descriptor, O_DIRECT (``open_direct``)
        self._direct_finalizer = None

    @property
    def closed(self) -> bool:
        return self._fd is None

    def fileno(self) -> int:
        fd = self._fd
        if fd is None:
            raise ArgumentError(
                f"{self.name}: the checkpoint was closed; open it again to read from it", "checkpoint file"
            )
        return fd

    def direct_fileno(self) -> int | None:
        """The O_DIRECT descriptor of this same open file, if ``open_direct`` made one."""
        self.fileno()  # a closed file refuses, as for buffered reads
        return self._direct

    def open_direct(self, probe) -> str | None:
        """A second descriptor on the *same* open file (``/proc/self/fd``, checked to be the
        validated inode, never the path) with ``O_DIRECT``, kept for ``direct_fileno``; None, or why
        the file system refused it. ``probe(fd)`` reads through it once (an aligned read: some
        file systems take the flag at open and refuse the reads)."""
        if self._direct is not None:
            return None
        if not getattr(os, "O_DIRECT", 0):
            return "this platform has no O_DIRECT"
        flags = os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(f"/proc/self/fd/{self.fileno()}", flags)
        except OSError as exc:
            return f"open with O_DIRECT: {type(exc).__name__}: {exc.strerror or exc}"
        try:
            same = FileIdentity.of(os.fstat(fd))
            if (same.device, same.inode) != (self.identity.device, self.identity.inode):
                raise OSError(0, "the descriptor names another file")
            probe(fd)
        except OSError as exc:
            os.close(fd)
            return f"O_DIRECT read: {type(exc).__name__}: {exc.strerror or exc}"
        with self._lock:
            self._direct = fd
            self._direct_finalizer = weakref.finalize(self, os.close, fd)
        return None

    def pread_into(self, buf: memoryview, offset: int) -> int:
        """Fill ``buf`` from ``offset``; returns the bytes read (fewer only at end of file)."""
        fd, done = self.fileno(), 0
        while done < len(buf):
            chunk = os.preadv(fd, [buf[done:]], offset + done)
            if chunk == 0:
                break
            done += chunk
        return done

    def pread(self, size: int, offset: int) -> bytes:
        buf = bytearray(size)
        return bytes(buf[: self.pread_into(memoryview(buf), offset)])

    def changes(self) -> list[str]:
        """What changed since the file was opened: in place (``fstat``) or at its path (``stat``)."""
        problems = []
        try:
            now = FileIdentity.of(os.fstat(self.fileno()))
        except (OSError, ValueError) as exc:
            return [f"{self.name}: cannot check it is unchanged: {exc}"]
        if diff := self.identity.differences(now):
            problems.append(
                f"{self.name} was rewritten in place after it was validated ({', '.join(diff)}); "
                "refusing what was read from it"
            )
        try:
            at_path = FileIdentity.of(os.stat(self.path))
        except OSError as exc:
            at_path, gone = None, f"{type(exc).__name__}: {exc.strerror}"
        else:
            gone = ", ".join(self.identity.differences(at_path))
        if gone:
            problems.append(
                f"{self.name} was replaced after it was validated ({gone}): its path now names "
                "other bytes than the ones this rank loaded"
            )
        return problems

    def close(self) -> None:
        with self._lock:
            self._fd = self._direct = None
            self._finalizer()
            if self._direct_finalizer is not None:
                self._direct_finalizer()

    def __getstate__(self):  # a descriptor means nothing in another process: a copy is closed
        return {"path": self.path, "name": self.name, "identity": self.identity}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._fd, self._lock = None, threading.Lock()
        self._direct, self._direct_finalizer = None, None
        self._finalizer = weakref.finalize(self, lambda: None)

    def __repr__(self) -> str:
        return f"OpenFile({self.name!r}{', closed' if self.closed else ''})"


def open_regular(path: Path, name: str, problems: list[str]) -> OpenFile | None:
    """``path`` opened read-only if it is a regular file; None (and a problem) otherwise.
    Never blocks: a named pipe or device is refused by ``fstat`` before anything is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        problems.append(f"{name}: cannot open: {type(exc).__name__}: {exc.strerror or exc}")
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            problems.append(f"{name} is {_kind(st.st_mode)}, not a regular file; refusing to read it")
            return None
        os.set_blocking(fd, True)  # regular files never block; reads then behave as usual
    except OSError as exc:
        os.close(fd)
        problems.append(f"{name}: cannot read: {type(exc).__name__}: {exc.strerror or exc}")
        return None
    return OpenFile(Path(path), name, fd, FileIdentity.of(st))


def _too_deep(value: object, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


class _NotStrictJson(Exception):
    """Raised from inside ``json.loads``'s hooks and caught by ``load_json_object`` at once, which
    turns it into the caller's problem; never leaves this module."""


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    # json.loads keeps the last of two equal keys; a tensor named twice must be refused.
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise _NotStrictJson(f"duplicate key `{short_repr(key)[1:-1]}`")
        seen[key] = value
    return seen


def _no_constant(name: str):
    raise _NotStrictJson(f"non-standard constant {name} (JSON has no NaN or Infinity)")


def load_json_object(
    text: bytes | str, what: str, problems: list[str], max_depth: int | None = MAX_JSON_DEPTH, constants: bool = True
) -> dict | None:
    """Decode a JSON object; None (and a problem) when it is not one. UTF-8 without a BOM, no
    duplicate keys, nested at most ``max_depth`` levels (``None``: the parser's own bound only).
    ``constants=False`` refuses ``NaN`` / ``Infinity`` outright (as the safetensors library does
    in headers); otherwise they parse as floats, for ``checkpoint.config_number_problems`` to
    name by their key."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        if bytes(text[:3]) == b"\xef\xbb\xbf":
            problems.append(f"{what} is not valid JSON: it starts with a byte-order mark (plain UTF-8 only)")
            return None
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.append(f"{what} is not valid JSON: not UTF-8 ({exc.reason} at byte {exc.start})")
            return None
    try:
        value = json.loads(
            text, object_pairs_hook=_no_duplicate_keys, **({} if constants else {"parse_constant": _no_constant})
        )
    except RecursionError:
        problems.append(f"{what} is not valid JSON here: nested too deeply to parse")
        return None
    except (ValueError, _NotStrictJson) as exc:
        problems.append(f"{what} is not valid JSON: {exc}")
        return None
    if not isinstance(value, dict):
        problems.append(f"{what} is not a JSON object (got {type(value).__name__})")
        return None
    if max_depth is not None and _too_deep(value, max_depth):
        problems.append(f"{what} is nested more than {max_depth} levels deep")
        return None
    return value


def read_json_file(path: Path, name: str, problems: list[str], max_bytes: int | None = None) -> dict | None:
    """The JSON object in ``path`` (which must exist); None (and a problem) otherwise.

    Reads at most its size at open plus one byte: a file above ``max_bytes`` (default
    ``MAX_JSON_BYTES``), or one that grows meanwhile, is refused.
    """
    max_bytes = MAX_JSON_BYTES if max_bytes is None else max_bytes
    handle = open_regular(path, name, problems)
    if handle is None:
        return None
    try:
        if handle.identity.size > max_bytes:
            problems.append(f"{name} is {handle.identity.size:,} bytes; JSON files above {max_bytes:,} are refused")
            return None
        raw = handle.pread(handle.identity.size + 1, 0)  # one byte more tells a file that grew
    except OSError as exc:
        problems.append(f"{name}: cannot read: {type(exc).__name__}: {exc.strerror or exc}")
        return None
    finally:
        handle.close()
    if len(raw) > handle.identity.size:
        problems.append(f"{name} grew while being read; refused")
        return None
    return load_json_object(raw, name, problems)


def present(path: Path) -> bool:
    """Whether a directory entry exists at ``path`` (even a dangling link); never raises."""
    try:
        os.lstat(path)
    except (OSError, ValueError):
        return False
    return True


SYMLINK_LOOP = "a symlink loop (a link that leads back to itself)"


def broken_link(path: str | Path) -> str | None:
    """What a symbolic link at ``path`` that leads nowhere is, in words ("a symlink loop", "a
    symbolic link to ``target``, which does not exist"), or None (no link, or one that resolves)."""
    try:
        os.stat(path)
        return None
    except ValueError:  # a NUL in the path: no link either
        return None
    except OSError as exc:
        if not os.path.islink(path):
            return None
        if exc.errno == errno.ELOOP:
            return SYMLINK_LOOP
        return f"a symbolic link to {os.readlink(path)}, which does not exist"
