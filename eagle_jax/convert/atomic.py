"""Directories that appear whole or not at all."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_directory(out: str | os.PathLike, *, keep_existing: bool = False):
    """Yield a fresh temporary directory beside `out`; when the block succeeds
    it is renamed to `out` (an existing `out` is moved aside first and removed
    after, or, with `keep_existing`, kept and the new copy dropped: for caches
    that another process may have filled meanwhile), when it fails it is
    deleted and `out` is left as it was."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        if out.exists() and keep_existing:
            shutil.rmtree(tmp, ignore_errors=True)
        elif out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / "x")
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old / "x", out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
