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


class OutputError(ValueError):
    """An output path that must not be written; the message names it and the fix."""


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_output(output, *, sources=(), overwrite: bool = False, fix: str = "choose a new output directory") -> Path:
    """Refuse an output directory that would destroy something: the current directory or one
    above it, a source being read (or a directory holding one, or one inside one), or an
    existing file or non-empty directory unless `overwrite`. `fix` ends the "exists" message."""
    output = Path(output)
    out = output.resolve()
    cwd = Path.cwd().resolve()
    if _within(cwd, out):
        raise OutputError(f"{output}: is the current directory or holds it; name a new directory to write")
    for source in sources:
        if source is None:
            continue
        src = Path(source).resolve()
        if _within(src, out) or _within(out, src):
            where = "is" if out == src else ("holds" if _within(src, out) else "is inside")
            raise OutputError(f"{output}: {where} the source {source}; write the output somewhere else")
    if output.is_symlink() or output.exists():
        if output.is_dir() and not output.is_symlink() and not any(output.iterdir()):
            return output
        if not overwrite:
            what = "exists and is not empty" if output.is_dir() else "exists (a file)"
            raise OutputError(f"{output}: {what}; {fix}")
    return output


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _as_umask_allows(root: Path) -> None:
    """Give `root` and everything under it the modes the user's umask allows: mkdtemp makes a
    private directory, and some writers (safetensors) make private files through temporaries."""
    mask = _umask()
    os.chmod(root, 0o777 & ~mask)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(folder, name), 0o777 & ~mask)
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, (0o666 | (os.stat(path).st_mode & 0o111)) & ~mask)


def atomic_dir(target, write) -> Path:
    """Call `write(tmp_dir)`, then swap `tmp_dir` in as `target` (replacing any old one, a
    directory or a file; nothing of it is left behind)."""
    given = Path(target)
    target = Path(os.path.abspath(given))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp."))
    try:
        write(tmp)
        _as_umask_allows(tmp)
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.old.{os.getpid()}"
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            _remove(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return given


def restore_swapped_dir(target) -> None:
    """Undo what a kill between atomic_dir's two renames leaves: no `target`, only its previous
    version (whole) as `.<name>.old.<pid>`, which goes back in place. Temporaries of writes cut
    short go. Safe when another process does the same at once."""
    target = Path(os.path.abspath(target))
    if not target.parent.is_dir():
        return
    olds = sorted(target.parent.glob(f".{target.name}.old.*"), key=lambda p: p.stat().st_mtime)
    if olds and not target.exists():
        try:
            os.replace(olds.pop(), target)
        except FileNotFoundError:
            pass
    for path in olds + sorted(target.parent.glob(f".{target.name}.tmp.*")):
        _remove(path)


def atomic_write_text(target, text: str) -> Path:
    return atomic_write_bytes(target, text.encode())


def atomic_write_bytes(target, data: bytes) -> Path:
    """Write `data` to a temporary sibling, then rename it to `target`."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
