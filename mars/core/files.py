"""Writing outputs so that a failure leaves nothing half-written: a temporary sibling, then a rename."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_dir(target, write) -> Path:
    """Call `write(tmp_dir)`, then swap `tmp_dir` in as `target` (replacing any old one)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp."))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; outputs are ordinary directories
    try:
        write(tmp)
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.old.{os.getpid()}"
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def atomic_write_text(target, text: str) -> Path:
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
