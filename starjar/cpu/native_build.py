"""C++ libraries of ours built once per machine by torch.utils.cpp_extension and loaded into the process.

A build needs a C++ compiler and ninja (about 15 s on 2 cores for the native passes). It is kept in
native_dir(), keyed by the sources, the library's name, the flags and torch's version, so later processes on
the machine load it. Where a library cannot be built the caller runs what it has without it; the reason is
returned for its warning.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

TORCH_BATON = "lock"  # the file cpp_extension creates while it builds, and waits on while it exists


def native_dir() -> Path:
    """Where built libraries are kept: $STARJAR_NATIVE_DIR, default ~/.cache/starjar/native (not under
    STARJAR_HOME, which tests and clusters point at fresh folders: one build serves every process)."""
    return Path(os.environ.get("STARJAR_NATIVE_DIR") or Path.home() / ".cache" / "starjar" / "native")


def build_key(name: str, files: Sequence[Path], flags: Sequence[str]) -> str:
    import torch  # torch's version keys the build: a library built for another torch does not load

    text = b"".join(f.read_bytes() for f in files)
    digest = hashlib.sha256(text + " ".join([name, *flags]).encode() + torch.__version__.encode())
    return digest.hexdigest()[:16]


def load(name: str, sources: Sequence[Path], headers: Sequence[Path] = (), flags: Sequence[str] = (),
         ldflags: Sequence[str] = (), what: str = "") -> tuple[bool, str]:
    """Build (once per machine) and load the library `name` from `sources`; (loaded, why not)."""
    from torch.utils import cpp_extension  # imported here: it is slow to import and only a build needs it

    build = native_dir() / build_key(name, [*sources, *headers], [*flags, *ldflags])
    bin_dir = os.path.dirname(sys.executable)  # the environment's ninja, where PATH (a Ray worker's) lacks it
    if shutil.which("ninja") is None and os.path.exists(os.path.join(bin_dir, "ninja")):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    what = what or name
    try:
        build.mkdir(parents=True, exist_ok=True)
        with build_lock(build, what):
            built = any(build.glob("*.so"))
            if not built:
                log.info("building %s for this machine (once) in %s", what, build)
            t0 = time.perf_counter()
            cpp_extension.load(name=name, sources=[str(f) for f in sources], extra_cflags=list(flags),
                               extra_ldflags=list(ldflags), build_directory=str(build), is_python_module=False,
                               verbose=False)
            if not built:
                log.info("%s built in %.1f s", what, time.perf_counter() - t0)
    except Exception as e:  # no compiler, no ninja, a read-only home: the caller runs without it
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        said = next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "")
        return False, f"{type(e).__name__}: {said}"
    return True, ""


@contextlib.contextmanager
def build_lock(build: Path, what: str):
    """One process at a time loads (and maybe builds) in `build`, under a lock the kernel drops when its holder
    dies. cpp_extension's own lock is a file that a build killed midway (Ctrl-C, OOM, a timeout) leaves behind,
    and every later load would wait on it forever: whoever holds this lock knows such a file is stale."""
    with open(build / "starjar.lock", "a") as f:  # closing it (or dying) lets the lock go
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process's build of %s in %s", what, build)
            fcntl.flock(f, fcntl.LOCK_EX)
        baton = build / TORCH_BATON
        if baton.exists():
            log.warning("%s: removing %s, left by a build that was stopped midway", what, baton)
            baton.unlink(missing_ok=True)
        yield
