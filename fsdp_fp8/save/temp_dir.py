"""The hidden temporary directory a save writes into, who made it, and what is left when it dies.

A save writes into ``.<name>.tmp-<host>-<machine>-<boot>-<namespace>-<pid>-<start>-<random>``
beside its target (:func:`make_temp_dir`) and renames it into place only when every rank has
written and synced (:func:`move_into_place`). The name carries its owner, so a later save (or
``fsdp-fp8 save --clean``) can tell a dead save's leftover from a live one, with no lock file.

:func:`judge` calls a leftover dead only when it is sure: the same host, boot and PID namespace
and no process ``pid`` with that start time, or the same machine in an earlier boot. Anything else
is left alone and named. Only directories whose whole name matches are ever looked at.

Rules and crash table: docs/reliability.md, "Saves".
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import socket
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

_OWNED = re.compile(
    r"^\.(?P<target>.+)\.tmp-(?P<host>[A-Za-z0-9_.-]+)-(?P<machine>[0-9a-f]{8})-(?P<boot>[0-9a-f]{8})"
    r"-(?P<namespace>[0-9a-f]{8})-(?P<pid>\d+)-(?P<start>\d+)-[a-z0-9_]+$"
)
_UNOWNED = re.compile(r"^\.(?P<target>.+)\.tmp-[a-z0-9_]{8}$")  # tempfile.mkdtemp's name, no owner
_UNKNOWN = "0" * 8


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _short_hash(*parts: str) -> str:
    if not any(parts):
        return _UNKNOWN
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


def pid_max() -> int:
    """The largest process id this kernel hands out (``/proc/sys/kernel/pid_max``; Linux's own
    ceiling, 2**22, where it cannot be read)."""
    text = _read("/proc/sys/kernel/pid_max")
    return int(text) if text.isdigit() else 1 << 22


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot); None if no such process
    runs; 0 if it runs but ``/proc`` does not say when it started (hidden, or no ``/proc``)."""
    text = _read(f"/proc/{pid}/stat")
    if text:
        fields = text.rsplit(")", 1)[-1].split()  # the command name, in parentheses, may hold spaces
        return int(fields[19]) if len(fields) > 19 else 0
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # another user's process: it exists
    return 0


@dataclass(frozen=True)
class Owner:
    """Who made a temporary directory."""

    host: str
    machine: str  # hash of /etc/machine-id (the same across reboots); _UNKNOWN when unknown
    boot: str  # hash of the kernel's boot id
    namespace: str  # hash of the PID namespace
    pid: int
    start: int

    @classmethod
    def this_process(cls) -> Owner:
        host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64] or "localhost"
        machine = _short_hash(_read("/etc/machine-id") or _read("/var/lib/dbus/machine-id"))
        try:
            namespace = os.readlink("/proc/self/ns/pid")
        except OSError:
            namespace = ""
        boot = _short_hash(_read("/proc/sys/kernel/random/boot_id"))
        pid = os.getpid()
        return cls(host, machine, boot, _short_hash(namespace), pid, process_start(pid) or 0)

    def token(self) -> str:
        return f"{self.host}-{self.machine}-{self.boot}-{self.namespace}-{self.pid}-{self.start}"


@dataclass(frozen=True)
class Leftover:
    """A save's temporary directory found beside a target, and the verdict on its owner."""

    path: Path
    owner: Owner | None  # None: an older fsdp_fp8's name, which says nothing of its owner
    dead: bool
    why: str


def judge(owner: Owner | None, me: Owner) -> tuple[bool, str]:
    """(dead, why) for a directory made by ``owner``, judged from the process ``me``."""
    if owner is None:
        return False, "its name does not say which process made it (an older fsdp_fp8)"
    who = f"pid {owner.pid} on {owner.host}"
    if owner.host != me.host:
        return False, f"made by {who}, another host, whose processes cannot be seen from here"
    if owner.boot == me.boot != _UNKNOWN and owner.namespace == me.namespace:
        start = process_start(owner.pid)
        if start is None:
            return True, f"made by {who}, which is no longer running"
        if owner.start and start and start != owner.start:
            return True, f"made by {who}, which is no longer running (its pid now belongs to another process)"
        return False, f"made by {who}, which is still running"
    if owner.machine == me.machine != _UNKNOWN and _UNKNOWN not in (owner.boot, me.boot) and owner.boot != me.boot:
        return True, f"made by {who} before this machine last restarted"
    return False, f"made by {who} in another PID namespace (a container) or boot, which cannot be seen from here"


def find_leftovers(parent: Path, me: Owner | None = None) -> list[Leftover]:
    """Every save's temporary directory in ``parent`` (any target name), judged."""
    me = me or Owner.this_process()
    found = []
    try:
        entries = sorted(os.scandir(parent), key=lambda e: e.name)
    except OSError:
        return []
    for entry in entries:
        owned, unowned = _OWNED.match(entry.name), _UNOWNED.match(entry.name)
        if not (owned or unowned) or not entry.is_dir(follow_symlinks=False):
            continue
        owner = None
        try:
            uid = entry.stat(follow_symlinks=False).st_uid
        except OSError:
            continue
        if uid != os.geteuid():
            found.append(Leftover(Path(entry.path), None, False, f"made by another user (uid {uid})"))
            continue
        if owned:
            g = owned.groupdict()
            pid = int(g["pid"])  # digits only, at most a file name long
            if not 0 < pid <= pid_max():  # 10**25 would overflow os.kill: no process ever had it
                why = f"its owner is unknown: the pid in its name, {g['pid']}, cannot be a process id here (1 to {pid_max():,})"
                found.append(Leftover(Path(entry.path), None, False, why))
                continue
            owner = Owner(g["host"], g["machine"], g["boot"], g["namespace"], pid, int(g["start"]))
        dead, why = judge(owner, me)
        found.append(Leftover(Path(entry.path), owner, dead, why))
    return found


@dataclass
class Cleaning:
    """What ``clean_leftovers`` did: removed (dead owners), kept (live or not judged), failed."""

    removed: list[Leftover] = field(default_factory=list)
    kept: list[Leftover] = field(default_factory=list)
    failed: list[tuple[Leftover, str]] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"removed {x.path}, left by an interrupted save ({x.why})" for x in self.removed]
        out += [f"left {x.path} alone: {x.why}" for x in self.kept]
        out += [f"could not remove {x.path} ({x.why}): {error}" for x, error in self.failed]
        return out


def clean_leftovers(parent: Path) -> Cleaning:
    """Remove the temporary directories of dead saves in ``parent``; what was done, for the
    caller to say once (``Cleaning.lines``: a save logs them, ``save --clean`` prints them)."""
    cleaning = Cleaning()
    for leftover in find_leftovers(parent):
        if not leftover.dead:
            cleaning.kept.append(leftover)
            continue
        try:
            shutil.rmtree(leftover.path)
            cleaning.removed.append(leftover)
        except OSError as exc:
            cleaning.failed.append((leftover, f"{type(exc).__name__}: {exc}"))
    return cleaning


def make_temp_dir(directory: Path) -> Path:
    """A new, empty temporary directory beside ``directory`` (mode 0700 while it is written),
    named for this process (the parents are created as ``mkdir -p`` would)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{directory.name}.tmp-{Owner.this_process().token()}-"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=directory.parent))


def umask() -> int:
    """This process's umask, read without changing it where the kernel tells (Linux >= 4.7)."""
    for line in _read("/proc/self/status").splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    mask = os.umask(0o022)  # the only portable way to read it: set and restore at once
    os.umask(mask)
    return mask


def publish_modes(tmp: Path) -> None:
    """Give ``tmp`` and everything in it the modes any new file of the user gets (the umask):
    ``mkdtemp`` made it 0700, which nobody else could read on a shared filesystem."""
    mask = umask()
    os.chmod(tmp, 0o777 & ~mask)
    for entry in os.scandir(tmp):
        if entry.is_file(follow_symlinks=False):
            os.chmod(entry.path, 0o666 & ~mask)


def sync_directory(path: Path) -> None:
    """Make the entries of ``path`` (created, renamed) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _CANNOT_SYNC_A_DIRECTORY:
            raise  # EIO and the like: the entries may not be durable, and the save must not say it is done
    finally:
        os.close(fd)


# What a filesystem that cannot sync a directory answers (the data itself was synced).
_CANNOT_SYNC_A_DIRECTORY = {
    errno.EINVAL,
    errno.EBADF,
    errno.ENOSYS,
    getattr(errno, "ENOTSUP", errno.EINVAL),
    getattr(errno, "EOPNOTSUPP", errno.EINVAL),
}


def move_into_place(tmp: Path, directory: Path) -> None:
    """Rename the finished ``tmp`` to ``directory`` (absent, or an empty directory), durably."""
    publish_modes(tmp)
    sync_directory(tmp)
    if directory.exists() and stat.S_ISDIR(directory.lstat().st_mode):
        directory.rmdir()  # empty (checked before the save began): rename replaces no directory portably
    os.rename(tmp, directory)
    sync_directory(directory.parent)
