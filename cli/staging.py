"""Write a set of files into a directory all at once, or not at all.

    check_destination(out, force)         # refuse a non-empty directory unless force
    check_space(out, nbytes)              # before anything is created
    with Staged(out, force) as stage:     # files go to a hidden folder inside out ...
        write_files(stage.path)
    # ... and are renamed into out on success; on an error, Ctrl-C or a full disk the hidden
    # folder (and any directory Staged created) is removed, and out is as it was.

Renames stay on one filesystem (the hidden folder is inside ``out``), so each file appears
complete or not at all. Files are made readable by everyone the umask allows (0644 with the
usual umask 022), whatever the writer used. With ``force``, weight files of an older checkpoint
that the new one does not replace (``model*.safetensors``, the index) are removed at the end,
so the directory never mixes two checkpoints.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from pdflash import PdflashError

STAGING_PREFIX = ".pdflash-partial-"
STALE_WEIGHTS = ("model*.safetensors", "model.safetensors.index.json")


def human_bytes(n: int | float) -> str:
    """Decimal units with three significant figures: 812 B, 1.02 MB, 13.1 GB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            v = n / scale
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{int(n)} B"


def check_destination(out: Path, force: bool, flag: str = "OUT_DIR") -> None:
    """PdflashError when ``out`` is a file, or a non-empty directory and ``force`` is off."""
    if out.exists() and not out.is_dir():
        raise PdflashError(f"{out} exists and is not a directory: choose a directory path for {flag}")
    if out.is_dir() and not force:
        try:
            entries = sorted(p.name for p in out.iterdir())
        except OSError as exc:
            raise PdflashError(f"cannot read {out} ({exc.strerror}): choose a directory you can write") from None
        if entries:
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise PdflashError(f"{out} is not empty (it holds {shown}): choose a new or empty directory, "
                               "or pass --force to replace the checkpoint files in it")


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem that holds ``path`` or its nearest existing parent."""
    try:
        st = os.statvfs(_existing_ancestor(path))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_space(out: Path, nbytes: int) -> None:
    free = free_bytes(out)
    if free is not None and free < nbytes:
        raise PdflashError(f"writing {out} needs {human_bytes(nbytes)} but only {human_bytes(free)} are free on its "
                           "filesystem: free some space or choose a directory on a larger disk")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class Staged:
    """See the module docstring. ``path`` is the hidden folder to write into."""

    def __init__(self, out: Path, force: bool = False):
        self.out = Path(out)
        self.force = force
        self.path = self.out / f"{STAGING_PREFIX}{uuid.uuid4().hex[:8]}"
        self._created: list[Path] = []  # directories this object made, outermost first

    def __enter__(self) -> "Staged":
        missing = []
        p = self.out.absolute()
        while not p.exists():
            missing.append(p)
            p = p.parent
        try:
            for d in reversed(missing):
                d.mkdir()
                self._created.append(d)
            self.path.mkdir()
        except BaseException:  # __exit__ does not run when __enter__ fails
            self._discard()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            try:
                self._commit()
            except BaseException:
                self._discard()
                raise
            return False
        self._discard()
        return False

    def _commit(self) -> None:
        mask = _umask()
        new_names = {p.name for p in self.path.iterdir()}
        if self.force:
            for pattern in STALE_WEIGHTS:
                for old in self.out.glob(pattern):
                    if old.name not in new_names and old.is_file():
                        old.unlink()
        _move_tree(self.path, self.out, mask)
        shutil.rmtree(self.path, ignore_errors=True)

    def _discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        for d in reversed(self._created):  # innermost first; only if still empty
            try:
                d.rmdir()
            except OSError:
                break


def _move_tree(src: Path, dst: Path, mask: int) -> None:
    """Rename every file of ``src`` to the same place under ``dst`` (merging directories)."""
    for entry in sorted(src.iterdir()):
        target = dst / entry.name
        if entry.is_dir():
            if target.exists() and not target.is_dir():
                target.unlink()
            target.mkdir(exist_ok=True)
            os.chmod(target, 0o777 & ~mask)
            _move_tree(entry, target, mask)
        else:
            os.chmod(entry, 0o666 & ~mask)
            os.replace(entry, target)
