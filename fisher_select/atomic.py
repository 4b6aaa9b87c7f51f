"""Atomic outputs: every file or directory fisher_select writes is complete or absent.

Writers fill a temporary sibling (same filesystem, so the final rename is atomic) and rename
it into place; on any error, KeyboardInterrupt included, the temporary is removed and the
target is left as it was. ``refuse_existing`` is the one overwrite check, run before any work.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import tempfile
import uuid
from pathlib import Path
from typing import Callable, Iterable

from fisher_select.errors import FisherSelectError, ResourceError


class Terminated(BaseException):
    """SIGTERM (a cluster's time limit, a preemption) turned into an exception, so that every
    writer's cleanup runs as it does for KeyboardInterrupt."""


def _raise_terminated(signum, frame):
    raise Terminated(signum)


def raise_on_sigterm() -> None:
    """Handle SIGTERM as Python handles SIGINT: an exception that unwinds every writer's cleanup."""
    signal.signal(signal.SIGTERM, _raise_terminated)


def _owner_tag() -> str:
    """Temporary names carry host and pid, so a later run can tell an orphan from a live writer."""
    return f"{socket.gethostname()}-{os.getpid()}"


_TEMP = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<host>.+)-(?P<pid>\d+)-[0-9a-z_]+$")


def remove_stale_temporaries(target: Path) -> list[Path]:
    """Remove temporaries of ``target`` left by a writer of this host that no longer runs (killed)."""
    removed = []
    if not target.parent.is_dir():
        return removed
    for path in target.parent.iterdir():
        m = _TEMP.match(path.name)
        if not m or m["name"] != target.name or m["host"] != socket.gethostname() or _alive(int(m["pid"])):
            continue
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def refuse_existing(paths: Iterable[Path], overwrite: bool) -> None:
    """Refuse to replace an existing file or non-empty directory unless ``overwrite``."""
    for path in map(Path, paths):
        if path.is_dir():
            if not any(path.iterdir()):
                continue
            if not overwrite:
                raise FisherSelectError(
                    f"output directory {path} already holds files (another run?); pass overwrite=True "
                    "(--overwrite on the command line) to replace it, or choose another --out")
        elif path.exists() and not overwrite:
            raise FisherSelectError(
                f"{path} already exists; pass overwrite=True (--overwrite on the command line) "
                "to replace it, or choose another --out")


def check_writable(directory: Path, need_bytes: int = 0) -> None:
    """``directory`` can be created (or exists) and written, with room for ``need_bytes`` more."""
    probe = Path(directory).absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise FisherSelectError(f"cannot create {directory}: {probe} is a file, not a directory; choose another --out")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise FisherSelectError(f"cannot write in {probe} (permission denied or read-only); choose another --out")
    free = shutil.disk_usage(probe).free
    if need_bytes > free:
        raise ResourceError(
            f"{probe} has {free / 2**30:.2f} GiB free but the outputs need about {need_bytes / 2**30:.2f} GiB; "
            "free space or choose another --out")


def check_dir_target(out: Path, overwrite: bool, need_bytes: int = 0) -> None:
    """Run before any work: ``out`` must be a directory path that may be (re)placed, with room."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FisherSelectError(f"output path {out} exists and is not a directory; choose another --out")
    refuse_existing([out], overwrite)
    check_writable(out.parent, need_bytes)


def write_file(target: Path, writer: Callable[[Path], None], *, overwrite: bool) -> Path:
    """Call ``writer(tmp)`` on a temporary path next to ``target``, then rename it onto ``target``.

    The writer creates the file itself, so it gets the usual umask permissions (mkstemp's 0600
    would survive the rename).
    """
    target = Path(target)
    refuse_existing([target], overwrite)
    check_writable(target.parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target)
    tmp = target.with_name(f".{target.name}.tmp-{_owner_tag()}-{uuid.uuid4().hex[:8]}")
    try:
        writer(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def write_dir(out: Path, writer: Callable[[Path], None], *, overwrite: bool) -> Path:
    """Call ``writer(tmpdir)`` then move the finished directory to ``out`` in one rename.

    An existing non-empty ``out`` is replaced only with ``overwrite``.
    """
    out = Path(out)
    check_dir_target(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{_owner_tag()}-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; an output directory is an ordinary one
    try:
        writer(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def publish_dir(tmp: Path, final: Path, complete: Callable[[Path], bool]) -> Path:
    """Move a finished ``tmp`` to ``final`` unless another process already published a complete one.

    For shared caches: on POSIX a rename onto a non-empty directory fails, so the first writer
    wins and later ones discard their copy.
    """
    try:
        os.replace(tmp, final)
    except OSError:
        if not complete(final):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _replace_dir(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.replace(tmp, out)
        return
    trash = out.with_name(f".{out.name}.old-{_owner_tag()}-{uuid.uuid4().hex[:8]}")
    os.replace(out, trash)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(trash, out)
        raise
    shutil.rmtree(trash, ignore_errors=True)
