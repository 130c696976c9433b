"""Files on disk: atomic writes (temp file beside the target, fsync, rename into place), durable
renames, where cflow keeps its caches, and how a write that the file system refuses is reported.

A crash or an exception mid-write leaves the old file (or nothing) and no temporary behind.
`writing(path)` turns an OSError into WriteError, one line `cannot write PATH: REASON`, and
`check_writable(path)` raises it up front, before a long job that would only fail at its end.

What a writer may replace (`write_target`, used by both): only a regular file, or nothing. A
target that exists as anything else (a device such as /dev/null, a directory, a FIFO, a socket)
is refused. A symlink is written through: the new file replaces the symlink's target, atomically
beside it, and the link stays. Missing parent folders are an error unless the caller asks for
them (`mkdir=True`: cflow's own caches, and folders a user named with --mkdir or as a run's
output directory).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import IO, Iterator

from cflow.errors import CflowError


class WriteError(CflowError, OSError):
    """A file or directory cflow must write cannot be written (read-only, missing, not a directory, full).

    Also an OSError, so code that already catches OSError around a write keeps working.
    """


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


def write_target(path: str | os.PathLike, *, mkdir: bool = False) -> Path:
    """The file a write to `path` replaces: `path`, or the file its symlink(s) point to. Raises
    WriteError when that exists and is not a regular file, or (mkdir=False) when its folder is
    missing; with mkdir=True the folders are created."""
    path = Path(path)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        st = os.stat(target)
    except (FileNotFoundError, NotADirectoryError):  # nothing there (the folder check below says why)
        st = None
    except OSError as e:
        raise WriteError(f"cannot write {path}: {e.strerror or e}") from e
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = next((what for test, what in _KINDS if test(st.st_mode)), "not a regular file")
        via = f" (the symlink {path} points to {target})" if target != path else ""
        raise WriteError(f"cannot write {path}: it is {kind}{via}, not a regular file; give a file path")
    parent = target.parent
    if not parent.is_dir():
        if parent.exists():
            raise WriteError(f"cannot write {path}: {parent} is not a directory")
        if not mkdir:
            raise WriteError(f"cannot write {path}: the folder {parent} does not exist; create it first"
                             " (mkdir -p), or pass --mkdir where the command has it")
        with writing(path):
            parent.mkdir(parents=True, exist_ok=True)
    return target


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", *, mkdir: bool = False) -> Iterator[IO]:
    """Open a temporary file for writing; on clean exit it replaces `path` (see write_target: a
    regular file or nothing; a symlink's target), on error it vanishes."""
    path = write_target(path, mkdir=mkdir)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the file normal permissions
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename inside `directory` durable (best effort where directories can't be opened)."""
    try:
        fsync_file(directory)
    except OSError:
        pass


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file written by someone else's writer (safetensors, shutil) to disk; errors raise."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Report an OSError raised inside the block as WriteError: `cannot write PATH: REASON`."""
    try:
        yield
    except WriteError:
        raise  # an inner block already named the path
    except OSError as e:
        raise WriteError(f"cannot write {path}: {e.strerror or e}") from e


def check_writable(path: str | os.PathLike, *, file: bool = False, mkdir: bool = False) -> None:
    """Raise WriteError now if `path` (a file or directory to create or replace; file=True: a file,
    which write_target's rules apply to: an existing directory, device, FIFO or socket there, or,
    unless mkdir=True, a missing folder is an error) cannot be written, so a read-only or impossible
    location fails before minutes of work. Root ignores permission bits, so only a real attempt
    tells: a throwaway file is created and removed in the nearest existing folder (inside `path`
    when it is an existing directory). Nothing is left behind; missing folders are not created.
    """
    path = Path(os.path.abspath(path))
    if file:  # write_target's refusals now; a folder mkdir would create is probed at its nearest ancestor
        target = Path(os.path.realpath(path)) if path.is_symlink() else path
        path = target if mkdir and not target.parent.exists() else write_target(path)
    with writing(path):
        if path.is_dir():
            if file:
                raise IsADirectoryError(errno.EISDIR, "it is a directory; give a file name inside it")
            folder = path
        else:
            folder = path.parent
            while not folder.exists() and folder != folder.parent:
                folder = folder.parent
        if not folder.is_dir():  # mkdir would say "File exists", which misleads
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(folder))
        fd, probe = tempfile.mkstemp(prefix=".cflow-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)


def read_json_dict(path: str | os.PathLike) -> dict:
    """A JSON object from `path`, or {} when the file is missing, unreadable or not an object:
    for bookkeeping files whose loss only costs redone work."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def cache_dir() -> Path:
    """Root of cflow's caches (converted GGUFs, tokenizers, token files): $CFLOW_CACHE, else
    ~/.cache/cflow."""
    env = os.environ.get("CFLOW_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "cflow"


def atomic_write_text(path: str | os.PathLike, text: str, *, mkdir: bool = False) -> None:
    with atomic_open(path, "w", mkdir=mkdir) as f:
        f.write(text)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, mkdir: bool = False) -> None:
    with atomic_open(path, "wb", mkdir=mkdir) as f:
        f.write(data)
