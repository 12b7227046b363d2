"""Files that survive crashes and concurrent processes: atomic writes, JSON that names its file, and locks.

`atomic_write` is the one write-then-rename of the repository (checkpoints, token shards, meta.json, results):
the bytes go to a temporary file with a unique name beside the target, are forced to disk (fsync), and the
file is renamed over the target; the directory is then fsync'd so that the rename itself survives a power
cut. After a crash at any point the target is either the old file or the new one, never a partial one, and
two processes writing one target at once each rename a complete file into place.

`locked` is an exclusive `flock` on a lock file, released by the kernel when its process ends (also on
`kill -9`), so a stale lock never needs cleaning up. Lock files are never deleted: a process waiting on a
deleted file's lock would hold a lock nobody else sees.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import uuid
from typing import Any, Callable, Iterator

from infra import cli


class DamagedFileError(cli.UserError, ValueError):
    """A file whose content cannot be read as what it should be (JSON that does not parse)."""


def fsync_path(path: str) -> None:
    """Force a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Call write(tmp) to create a temporary file, then sync it and rename it to `path` (see the module doc)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # write() or the sync failed: leave nothing behind
            os.remove(tmp)
    fsync_path(directory)


def write_json(path: str, obj: Any, default: Callable[[Any], Any] | None = None) -> None:
    """json.dump, atomically; `default` converts what JSON cannot hold, as in json.dump."""
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, default=default)
    atomic_write(path, write)


def read_json(path: str) -> Any:
    """json.load, with an error that names the file."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DamagedFileError(f"{path} is not valid JSON ({e}): a damaged or hand-edited file?") from None


@contextlib.contextmanager
def locked(path: str, *, wait: bool, holder_of: str) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if needed) for the duration of the block.

    wait=False: if another process holds it, raise cli.InUseError (a FileExistsError) naming that process and
    `holder_of` (what the lock protects). wait=True: say who holds it on stderr and wait for it.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            if not wait:
                raise cli.InUseError(f"{holder_of} is in use by {holder} (lock file {path})") from None
            print(f"waiting for {holder}, which holds {path} ({holder_of})", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
