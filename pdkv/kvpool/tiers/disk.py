"""Local disk tier: one file per chunk, LRU by bytes, capacity shared by every process that uses
the directory (torch-free).

Layout of the directory: `<name>.kv` per entry, where name is the key with ':' turned into '_'
(and any character outside [A-Za-z0-9.-] escaped as %XX, so distinct keys never share a file);
`.tmp-<pid>-<tier id>-<n>-<name>` files are writes in progress (the tier id, random per DiskTier,
keeps two tiers of one process, e.g. two engines, from writing one temporary name). A put writes
the whole value to a temporary file in the same directory and renames it over the final name
(`os.replace`, atomic on POSIX), so a reader never sees a half-written entry under its final
name.

Durability (`fsync`, default on): the temporary file is fsync'ed before the rename and the
directory after it, so once `put` returns the entry survives a power loss under its final name
with its full contents. With fsync off a renamed file may be short or garbage after power loss;
the store's checksum (`pdkv.kvpool.codec`) turns that into a miss, so turning it off trades a
cold restart after a crash for cheaper writes (`pdkv bench pool --disk-fsync` measures the cost).
Start-up removes `.tmp-*` leftovers of processes that no longer run (never those of a running
process, this one included: another tier in it may be writing them).

Capacity across processes: several processes (engines of one host) may share a directory, and
`capacity_bytes` bounds the directory, not one process's writes. The accounting is the directory
itself: every put lists it (under this tier's lock; one stat per file it has not seen before;
about 4 ms per thousand entries on a loaded 2-core box) and evicts the least recently used files,
whoever wrote them, until the new value fits. A shared counter file with a lock was the
alternative; it was not chosen because a process that dies between its rename and its update
leaves the counter wrong for good, while a listing cannot drift. Between puts the in-memory index
may be stale: an entry another process evicted is still listed until the next put, and reading
it is a miss (the vanished file is dropped from the index), never an error. Concurrent writers
can together overshoot by the values they are writing at that moment (temporary files are not
counted), at most one chunk each. LRU order: within one process the index keeps exact use order
(files of other processes join it when first seen, oldest mtime first); across processes a read
refreshes the file's mtime, and a file about to be evicted whose mtime changed since this tier
saw it (another process read it) gets a second chance. Start-up orders the index by mtime.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from pdkv.kvpool.tiers.base import Tier, TierError
from pdkv.procgroup import pid_alive

SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-")


def key_to_filename(key: str) -> str:
    """File name of a key: ':' → '_', other characters outside [A-Za-z0-9.-] → %XX per UTF-8
    byte, plus ".kv" (injective, never starts with '.tmp-' or contains '/')."""
    out: list[str] = []
    for ch in key:
        if ch in _SAFE:
            out.append(ch)
        elif ch == ":":
            out.append("_")
        else:
            out.extend(f"%{b:02X}" for b in ch.encode())
    name = "".join(out)
    if name.startswith("."):
        name = "%2E" + name[1:]
    return name + SUFFIX


def filename_to_key(name: str) -> str | None:
    """The key whose file is `name` (the inverse of `key_to_filename`), or None when `name` is
    not such a file name."""
    if not name.endswith(SUFFIX):
        return None
    text = name[: -len(SUFFIX)].replace("_", ":")
    if "%" not in text:
        return text
    out = bytearray()
    i = 0
    try:
        while i < len(text):
            if text[i] == "%":
                out.append(int(text[i + 1 : i + 3], 16))
                i += 3
            else:
                out.extend(text[i].encode())
                i += 1
        return out.decode()
    except (ValueError, UnicodeDecodeError):
        return None


class DiskTier(Tier):
    """Chunks as files under `path`, at most `capacity_bytes` of `.kv` file contents in the
    directory (all processes together, see the module docstring), LRU eviction (files deleted).
    Thread-safe: the index is guarded by a lock, held for the rescan, rename and evictions of a
    put; file reads and the data writes run outside it.

    KV events (`set_event_listener`), reported under the lock: a put reports the files it
    evicted and the entries whose files it found gone (another process evicted them), then the
    key it stored; `remove` and a read that finds the file gone report the key.

    Args:
        path: directory (created if missing).
        capacity_bytes: most bytes of values held in the directory (> 0).
        fsync: fsync each written file before its rename and the directory after it (durable
            once `put` returns); False skips both (faster; a crash may leave damaged entries,
            which the store's checksum turns into misses).

    Raises:
        ValueError: capacity_bytes <= 0.
        OSError: the directory cannot be created or listed.
    """

    name = "disk"
    local_index = True

    def __init__(self, path: str, capacity_bytes: int, fsync: bool = True) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.path = path
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self._lock = threading.Lock()
        # file name -> (size in bytes, mtime in ns as last seen), least recently used first
        self._index: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._used = 0
        self._evictions = 0
        self._tmp_ids = itertools.count()
        self._tmp_tag = f"{os.getpid()}-{secrets.token_hex(4)}"
        os.makedirs(path, exist_ok=True)
        self._remove_stale_temporaries()
        with self._lock:
            self._refresh_locked()
            self._evict_locked(0)
            self._evictions = 0

    def _remove_stale_temporaries(self) -> None:
        """Delete `.tmp-<pid>-*` files whose writer is not running (a crash's leftovers); those
        of live processes sharing the directory, this one included (another tier of this
        process), are writes in progress and stay."""
        with os.scandir(self.path) as it:
            for entry in it:
                if not entry.name.startswith(TMP_PREFIX):
                    continue
                pid_text = entry.name[len(TMP_PREFIX):].split("-", 1)[0]
                if pid_text.isdigit() and pid_alive(int(pid_text)):
                    continue
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)

    def _refresh_locked(self) -> list[str]:
        """Make the index the directory's contents: drop entries whose file is gone and add new
        `.kv` files (one stat each, oldest mtime first, as the most recently used). Known files
        are not stat'ed (a value never changes; their mtime is checked when they are about to be
        evicted). Returns the names dropped. Raises OSError if the directory cannot be
        listed."""
        names = {n for n in os.listdir(self.path)
                 if n.endswith(SUFFIX) and not n.startswith(TMP_PREFIX)}
        gone = [n for n in self._index if n not in names]
        for name in gone:
            del self._index[name]
        new: list[tuple[int, str, int]] = []
        for name in names.difference(self._index):
            try:
                st = os.stat(self._file(name), follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                new.append((st.st_mtime_ns, name, st.st_size))
        for mtime, name, size in sorted(new):
            self._index[name] = (size, mtime)
        self._used = sum(size for size, _ in self._index.values())
        return gone

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _evict_locked(self, incoming: int, keep: str = "") -> list[str]:
        """Delete least recently used files (never `keep`) until `incoming` more bytes fit.
        Before a file goes its mtime is read: a file another process used since this tier last
        saw it gets a second chance (moved to the most recent end, once per call); a file
        already deleted frees its bytes but is not counted as an eviction. Returns the names
        that left the index (deleted, or found gone)."""
        spared: set[str] = set()
        dropped: list[str] = []
        while self._used + incoming > self.capacity_bytes:
            victim = next((n for n in self._index if n != keep), None)
            if victim is None:
                return dropped
            size, seen = self._index[victim]
            try:
                mtime = os.stat(self._file(victim), follow_symlinks=False).st_mtime_ns
            except FileNotFoundError:
                del self._index[victim]
                self._used -= size
                dropped.append(victim)
                continue
            except OSError:
                mtime = seen
            if mtime != seen and victim not in spared:
                spared.add(victim)
                self._index[victim] = (size, mtime)
                self._index.move_to_end(victim)
                continue
            del self._index[victim]
            self._used -= size
            dropped.append(victim)
            try:
                os.unlink(self._file(victim))
            except OSError:
                continue  # gone already, or cannot be deleted (the next scan finds it again)
            self._evictions += 1
        return dropped

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key: the in-memory index first, then (for keys it lacks) one stat of
        the file, so entries another process wrote into a shared directory are found and
        adopted into the index. No LRU touch. An entry another process evicted since this
        tier's last scan may still be reported (its read is then a miss)."""
        names = [key_to_filename(k) for k in keys]
        with self._lock:
            found = [n in self._index for n in names]
        for i, name in enumerate(names):
            if not found[i]:
                found[i] = self._adopt(name)
        return found

    def _adopt(self, name: str) -> bool:
        """Index a complete file written by another process (renamed into place: never partial).
        Nothing is evicted for it: it is already on disk, and the next put's scan counts it."""
        try:
            st = os.stat(self._file(name))
        except OSError:
            return False
        with self._lock:
            if name not in self._index:
                self._index[name] = (st.st_size, st.st_mtime_ns)
                self._used += st.st_size
        return True

    def get(self, key: str) -> bytes | None:
        """The whole file as written (the store verifies it), or None when absent or the file
        vanished (e.g. evicted by another process sharing the directory). A hit becomes most
        recently used (index order and file mtime).

        Raises:
            TierError: kind "io" when the file exists but cannot be read.
        """
        name = key_to_filename(key)
        with self._lock:
            known = name in self._index
            if known:
                self._index.move_to_end(name)
        if not known and not self._adopt(name):
            return None
        try:
            with open(self._file(name), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self._forget(name)
            return None
        except OSError as e:
            raise TierError(f"disk read of {name} failed: {e}", "io") from e
        now = time.time_ns()
        with contextlib.suppress(OSError):  # LRU order across processes is a hint only
            os.utime(self._file(name), ns=(now, now))
            mtime = os.stat(self._file(name)).st_mtime_ns  # as the file system stored it
            with self._lock:
                entry = self._index.get(name)
                if entry is not None:
                    self._index[name] = (entry[0], mtime)
        return data

    def _forget(self, name: str) -> None:
        with self._lock:
            entry = self._index.pop(name, None)
            if entry is not None:
                self._used -= entry[0]
                self._report_names((name,))

    def _report_names(self, names: Sequence[str]) -> None:
        """Report the keys of file `names` as removed (KV events; caller holds the lock)."""
        if self.events is not None and names:
            self._report_removed([k for k in map(filename_to_key, names) if k is not None])

    def put(self, key: str, value: bytes) -> None:
        """Write `value` to a temporary file (fsync'ed when `fsync`), rename it to the key's
        file (then fsync the directory), rescan the directory and evict LRU files, whoever wrote
        them, until the directory holds at most `capacity_bytes`. An existing key keeps its file
        and becomes most recently used.

        Raises:
            TierError: kind "full" when len(value) > capacity_bytes; kind "io" when the write,
                an fsync, the rename or the scan fails (no file and no index entry are left
                behind, unless the rename succeeded: the entry is then in place).
        """
        size = len(value)
        if size > self.capacity_bytes:
            raise TierError(
                f"value of {size} bytes exceeds disk capacity {self.capacity_bytes}", "full"
            )
        name = key_to_filename(key)
        with self._lock:
            known = name in self._index
        if known:
            if os.path.exists(self._file(name)):
                with self._lock:
                    if name in self._index:
                        self._index.move_to_end(name)
                return
            self._forget(name)  # evicted by another process: write it again
        tmp = self._file(f"{TMP_PREFIX}{self._tmp_tag}-{next(self._tmp_ids)}-{name}")
        try:
            self._write(tmp, value, self.fsync)
            with self._lock:
                os.replace(tmp, self._file(name))
                # The scan indexes the new file with the other new ones (theirs too: they count
                # against capacity), oldest first; this one is then the most recent.
                self._index.pop(name, None)
                gone = self._refresh_locked()
                if name in self._index:
                    self._index.move_to_end(name)
                gone += self._evict_locked(0, keep=name)
                self._report_names([n for n in gone if n != name])
                self._report_stored(key)
            if self.fsync:
                _fsync_dir(self.path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise TierError(f"disk write of {name} failed: {e}", "io") from e

    @staticmethod
    def _write(path: str, value: bytes, fsync: bool) -> None:
        """Write `value` to a new file at `path` (fsync'ed when asked)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(value).cast("B")
            while view.nbytes:
                n = os.write(fd, view)
                if n <= 0:
                    raise OSError(errno.EIO, "short write")
                view = view[n:]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, key: str) -> None:
        """Drop `key`'s index entry and file if present."""
        name = key_to_filename(key)
        with self._lock:
            entry = self._index.pop(name, None)
            if entry is not None:
                self._used -= entry[0]
            try:
                os.unlink(self._file(name))
                unlinked = True
            except OSError:
                unlinked = False
            if entry is not None or unlinked:
                self._report_removed((key,))

    def bytes_in_use(self) -> int:
        """Bytes of `.kv` files in the directory (every process's) as of this tier's last scan
        (start-up or a put), plus entries adopted or minus entries dropped since."""
        with self._lock:
            return self._used

    def take_evictions(self) -> int:
        """Files this tier deleted for capacity since the last call (another process's files
        included; a file already gone is not counted)."""
        with self._lock:
            n, self._evictions = self._evictions, 0
            return n

    def close(self) -> None:
        """Nothing to release (files are closed after each call); entries stay on disk."""


def _fsync_dir(path: str) -> None:
    """fsync directory `path` (makes a rename or create in it durable). Raises OSError."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
