"""One process at a time in a run folder: an exclusive OS lock on `output_dir/.slidedp.lock`.

`slidedp train` (fresh, overwrite or resume) and `slidedp export` of a run folder (or of one of its
checkpoints) take it before they read or change anything in the folder. The lock is `flock`
(LOCK_EX | LOCK_NB) on an open file: the kernel drops it when the holding process ends, however it
ends (a SIGKILLed run never blocks the next one), so the file itself is never removed. The holder
writes its pid and hostname into the file; a second process is refused at once with
`RunFolderLocked`, whose message names them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from pathlib import Path

from slidedp.errors import SlidedpError

LOCK_FILE = ".slidedp.lock"
CHECKPOINTS = "checkpoints"


class RunFolderLocked(SlidedpError, ValueError):
    """Another process holds the run folder's lock; the message names its pid and host."""


def is_run_folder(path: Path) -> bool:
    """A folder `slidedp train` wrote into: it holds the lock file, or `checkpoints/` and `config.json`."""
    path = Path(path)
    return (path / LOCK_FILE).is_file() or ((path / CHECKPOINTS).is_dir() and (path / "config.json").is_file())


def run_folder_of(path: Path) -> Path | None:
    """The run folder that `path` is, or whose checkpoint (`RUN/checkpoints/step-N`) it is; else None."""
    path = Path(path).absolute()
    if is_run_folder(path):
        return path
    if path.parent.name == CHECKPOINTS and is_run_folder(path.parent.parent):
        return path.parent.parent
    return None


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    fields = dict(part.split("=", 1) for part in text.split() if "=" in part)
    if "pid" in fields:
        return f"pid {fields['pid']} on {fields.get('host', '?')}"
    return "another process"


@contextlib.contextmanager
def run_folder_lock(folder: str | os.PathLike, *, what: str = "slidedp train", mark: str = ""):
    """Hold the exclusive lock of the run folder `folder` (created if missing) while inside;
    raise `RunFolderLocked` at once, naming the holder, when another process holds it. `mark`: a
    word written beside the pid and host, flushed to the file system (under torchrun the other hosts
    look for it to check that they see the same folder: slidedp/train/job.py)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunFolderLocked(
                f"run folder {folder} is in use by {_holder(fd)} (lock file {folder / LOCK_FILE}): {what} "
                "refuses to touch it while that process runs; wait for it to end, stop it, or use another "
                "output_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid={os.getpid()} host={socket.gethostname()}{' ' + mark if mark else ''}\n".encode(), 0)
        if mark:
            os.fsync(fd)
        yield folder
    finally:
        os.close(fd)  # releases the lock
