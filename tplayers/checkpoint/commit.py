"""Durable renames: a fully written checkpoint (file or directory) moved into place so that a crash
leaves either the old or the new one (:func:`commit`), and directory fsyncs."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from typing import Optional

__all__ = ["commit", "fsync_dir"]


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap paths ``a`` and ``b`` (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def commit(tmp: str, target: str, *, remove_old: bool = True) -> Optional[str]:
    """Move the fully written and fsynced ``tmp`` (file or directory) to ``target``.

    - ``target`` absent: one ``rename``; the parent directory is fsynced.
    - ``target`` present: an atomic exchange (``renameat2``), then the old copy is
      deleted. A crash at any point leaves either the old or the new checkpoint
      at ``target``, plus at most a stray ``.*.tmp-*`` sibling.
    - Without ``renameat2`` a file is replaced with ``os.replace`` (atomic); a
      directory is renamed away first, so a crash between the two renames leaves
      ``target`` missing, with the old copy at ``.<name>.old-<token>`` and the new
      one complete at ``tmp``.

    ``remove_old=False`` leaves the previous copy for the caller to delete (the
    ranks share that work) and returns its path; None when there is none.
    """
    parent = os.path.dirname(os.path.abspath(target))
    old = None
    if not os.path.lexists(target):
        os.rename(tmp, target)
    elif _exchange(tmp, target):
        old = tmp  # tmp now holds the previous checkpoint
    elif not os.path.isdir(target) and not os.path.isdir(tmp):
        os.replace(tmp, target)
    else:
        old = os.path.join(parent, "." + os.path.basename(target) + ".old-" + os.path.basename(tmp).rsplit("-", 1)[-1])
        os.rename(target, old)
        os.rename(tmp, target)
    fsync_dir(parent)
    if old is not None and remove_old:
        _remove(old)
        return None
    return old
