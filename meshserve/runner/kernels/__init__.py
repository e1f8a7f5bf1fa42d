"""meshserve's C++ kernels for the cpu backend, compiled on first use.

The sources sit beside this file and are built with torch's ``cpp_extension`` (g++ and ninja) for
the CPU they run on (``-march=native``), once per source, torch version and CPU: the build lands in
``MESHSERVE_KERNEL_CACHE`` (default ``~/.cache/meshserve/kernels``) under a key of all three, so a
second process, or a restart, loads the library in well under a second without a compiler.
Concurrent first builds (several host actors starting at once) wait on one builder's flock.

``load()`` registers the ops under ``torch.ops.meshserve_cpu``; ``ops.py`` names the ones the
model calls and gives torch.compile the attention op's output shape.

Attention takes the fastest arithmetic the CPU offers for a cache's dtype and shape
(``ops.arithmetic``). ``MESHSERVE_CPU_ATTENTION`` (``auto``, ``tiles``, ``pairs`` or ``floats``,
read once per process) caps it, so that one machine can test and time the slower ones too: with
``pairs`` a CPU with AMX attends bf16 as one without it does.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

from meshserve.spmd.backend import cpu_flags

logger = logging.getLogger("meshserve.kernels")

_SOURCES = ("paged_attention.cpp",)
_HEADERS = ("row_state.h", "run_softmax.h", "float_rows.h", "pair_rows.h", "tile_rows.h")
_LIBRARY = "meshserve_cpu_kernels"
_lock = threading.Lock()
_loaded = False


def cache_dir() -> Path:
    root = os.environ.get("MESHSERVE_KERNEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "meshserve", "kernels")
    return Path(root) / _build_key()


def _build_key() -> str:
    """Sources, torch and the CPU's instruction set: a change to any of them needs a new build."""
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in _SOURCES + _HEADERS:
        digest.update((here / name).read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(platform.machine().encode())
    digest.update(" ".join(sorted(cpu_flags())).encode())
    return digest.hexdigest()[:16]


def load() -> None:
    """Build (first time on this machine) and load the kernels; safe to call repeatedly."""
    global _loaded
    with _lock:
        if _loaded:
            return
        library = cache_dir() / f"{_LIBRARY}.so"
        started = time.perf_counter()
        if not _build(library):
            torch.ops.load_library(str(library))
        logger.info("CPU kernels loaded from %s in %.1fs", library, time.perf_counter() - started)
        _loaded = True


def _build(library: Path) -> bool:
    """Build into a private folder and move the library into place; False if it was already built.

    The build also loads the library (cpp_extension does), so the caller must not load it again.
    An flock (released by the kernel if the process dies) serialises builders across processes, so
    several host actors starting at once build once; a builder killed half-way leaves only its
    private folder behind, never a lock that would make the next process wait for ever.
    """
    import fcntl
    import tempfile

    cpp_extension = _cpp_extension()
    if library.exists():
        return False
    library.parent.mkdir(parents=True, exist_ok=True)
    with open(library.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():  # another process built it while this one waited
            return False
        print("meshserve: building the CPU attention kernel (once per machine, ~30-60 s)...",
              file=sys.stderr, flush=True)
        started = time.perf_counter()
        _put_ninja_on_path()
        here = Path(__file__).parent
        with tempfile.TemporaryDirectory(dir=library.parent, prefix="build-") as scratch:
            cpp_extension.load(
                name=_LIBRARY, sources=[str(here / name) for name in _SOURCES],
                build_directory=scratch, is_python_module=False, verbose=False,
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                extra_ldflags=["-fopenmp"])
            os.replace(Path(scratch) / f"{_LIBRARY}.so", library)
        print(f"meshserve: CPU attention kernel built in {time.perf_counter() - started:.0f} s "
              f"({library})", file=sys.stderr, flush=True)
    return True


def _cpp_extension():
    """torch's ``cpp_extension``, imported without the warning it logs on a machine with a CUDA
    folder but no CUDA runtime: it looks for CUDA at import, and these builds are CPU only.
    Imported even when the library is built already, because inductor imports it to compile
    the forward that calls these kernels, and only the first import warns."""
    noisy = logging.getLogger("torch.utils.cpp_extension")
    level = noisy.level
    noisy.setLevel(max(level, logging.ERROR))
    try:
        from torch.utils import cpp_extension
    finally:
        noisy.setLevel(level)
    return cpp_extension


def _put_ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; the pip package's binary is there only when the
    venv is activated, and ``make`` calls ``.venv/bin/python`` without activating it."""
    try:
        import ninja
    except ImportError:  # a system ninja on PATH still works; cpp_extension says if it is missing
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR
