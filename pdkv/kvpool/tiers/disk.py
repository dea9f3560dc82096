"""Local disk tier: one file per chunk, LRU by bytes, index rebuilt at start-up (torch-free).

Layout of the directory: `<name>.kv` per entry, where name is the key with ':' turned into '_'
(and any character outside [A-Za-z0-9.-] escaped as %XX, so distinct keys never share a file);
`.tmp-*` files are writes in progress. A put writes the whole value to a temporary file in the
same directory and renames it over the final name (`os.replace`, atomic on POSIX), so a reader
never sees a half-written entry under its final name; after a crash only `.tmp-*` leftovers
remain, and start-up removes them. The index (file name → size, in LRU order) lives in memory
and is rebuilt from the directory at start-up in mtime order; `get` refreshes a file's mtime so
that order survives a restart. Content is verified by the store (`pdkv.kvpool.codec`), so a
corrupted or truncated file is caught on load; no fsync, so after power loss a renamed file may
be short or garbage, which that check turns into a miss.

One process per directory: two processes sharing a directory would each keep their own index.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence

from pdkv.kvpool.tiers.base import Tier, TierError

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


class DiskTier(Tier):
    """Chunks as files under `path`, at most `capacity_bytes` of file contents, LRU eviction
    (files deleted). Thread-safe: the index is guarded by a lock; file reads and the data writes
    run outside it (the rename and index update happen together under it).

    Args:
        path: directory (created if missing).
        capacity_bytes: most bytes of values held (> 0).

    Raises:
        ValueError: capacity_bytes <= 0.
        OSError: the directory cannot be created or listed.
    """

    name = "disk"
    local_index = True

    def __init__(self, path: str, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.path = path
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        self._evictions = 0
        self._tmp_ids = itertools.count()
        os.makedirs(path, exist_ok=True)
        self._rebuild()

    def _rebuild(self) -> None:
        """Remove leftover temporary files; index the entries oldest mtime first; evict down to
        capacity (it may have shrunk since the last run)."""
        found: list[tuple[int, str, int]] = []
        with os.scandir(self.path) as it:
            for entry in it:
                try:
                    if entry.name.startswith(TMP_PREFIX):
                        os.unlink(entry.path)
                    elif entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        found.append((st.st_mtime_ns, entry.name, st.st_size))
                except FileNotFoundError:
                    continue
        for _, name, size in sorted(found):
            self._index[name] = size
            self._used += size
        with self._lock:
            self._evict_locked(0)
            self._evictions = 0

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _evict_locked(self, incoming: int) -> None:
        while self._index and self._used + incoming > self.capacity_bytes:
            name, size = self._index.popitem(last=False)
            self._used -= size
            self._evictions += 1
            self._unlink(name)

    def _unlink(self, name: str) -> None:
        # A file that cannot be deleted stays as a stray; start-up re-indexes (and evicts) it.
        with contextlib.suppress(OSError):
            os.unlink(self._file(name))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key: the in-memory index first, then (for keys it lacks) one stat of
        the file, so entries another process wrote into a shared directory are found and
        adopted into the index (its capacity accounting then covers them too). No LRU touch."""
        names = [key_to_filename(k) for k in keys]
        with self._lock:
            found = [n in self._index for n in names]
        for i, name in enumerate(names):
            if not found[i]:
                found[i] = self._adopt(name)
        return found

    def _adopt(self, name: str) -> bool:
        """Index a complete file written by another process (renamed into place: never partial)."""
        try:
            size = os.stat(self._file(name)).st_size
        except OSError:
            return False
        with self._lock:
            if name not in self._index:
                self._evict_locked(size)
                self._index[name] = size
                self._used += size
        return True

    def get(self, key: str) -> bytes | None:
        """The whole file as written (the store verifies it), or None when absent or the file
        vanished. A hit becomes most recently used (index order and file mtime).

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
        with contextlib.suppress(OSError):  # LRU order across restarts is a hint only
            os.utime(self._file(name))
        return data

    def _forget(self, name: str) -> None:
        with self._lock:
            size = self._index.pop(name, None)
            if size is not None:
                self._used -= size

    def put(self, key: str, value: bytes) -> None:
        """Write `value` to a temporary file, then rename it to the key's file and index it,
        evicting LRU files to stay under capacity. An existing key keeps its file and becomes
        most recently used.

        Raises:
            TierError: kind "full" when len(value) > capacity_bytes; kind "io" when the write or
                the rename fails (no file and no index entry are left behind).
        """
        size = len(value)
        if size > self.capacity_bytes:
            raise TierError(
                f"value of {size} bytes exceeds disk capacity {self.capacity_bytes}", "full"
            )
        name = key_to_filename(key)
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
                return
        tmp = self._file(f"{TMP_PREFIX}{os.getpid()}-{next(self._tmp_ids)}-{name}")
        try:
            self._write(tmp, value)
            with self._lock:
                os.replace(tmp, self._file(name))
                old = self._index.pop(name, None)  # a concurrent put of the same key
                if old is not None:
                    self._used -= old
                self._evict_locked(size)
                self._index[name] = size
                self._used += size
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise TierError(f"disk write of {name} failed: {e}", "io") from e

    @staticmethod
    def _write(path: str, value: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(value).cast("B")
            while view.nbytes:
                n = os.write(fd, view)
                if n <= 0:
                    raise OSError(errno.EIO, "short write")
                view = view[n:]
        finally:
            os.close(fd)

    def remove(self, key: str) -> None:
        """Drop `key`'s index entry and file if present."""
        name = key_to_filename(key)
        with self._lock:
            size = self._index.pop(name, None)
            if size is not None:
                self._used -= size
            self._unlink(name)

    def bytes_in_use(self) -> int:
        """Sum of the indexed file sizes."""
        with self._lock:
            return self._used

    def take_evictions(self) -> int:
        """Entries evicted for capacity since the last call."""
        with self._lock:
            n, self._evictions = self._evictions, 0
            return n

    def close(self) -> None:
        """Nothing to release (files are closed after each call); entries stay on disk."""
