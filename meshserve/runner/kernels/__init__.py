"""meshserve's C++ kernels for the cpu backend, compiled on first use.

The sources sit beside this file and are built with torch's ``cpp_extension`` (g++ and ninja) for
the CPU they run on (``-march=native``), once per source, torch version and CPU: the build lands in
``MESHSERVE_KERNEL_CACHE`` (default ``~/.cache/meshserve/kernels``) under a key of all three, so a
second process, or a restart, loads the library in well under a second. Concurrent first builds
(several host actors starting at once) wait on cpp_extension's lock in that folder.

``load()`` registers the ops under ``torch.ops.meshserve_cpu``; ``ops.py`` wraps them as the
custom ops the model calls.
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

logger = logging.getLogger("meshserve.kernels")

_SOURCES = ("paged_attention.cpp",)
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
    for name in _SOURCES:
        digest.update((here / name).read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(platform.machine().encode())
    digest.update(_cpu_flags().encode())
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def load() -> None:
    """Build (first time on this machine) and load the kernels; safe to call repeatedly."""
    global _loaded
    with _lock:
        if _loaded:
            return
        from torch.utils import cpp_extension

        build = cache_dir()
        build.mkdir(parents=True, exist_ok=True)
        fresh = not any(build.glob(f"{_LIBRARY}*.so"))
        if fresh:
            print("meshserve: building the CPU attention kernel (once per machine, ~30 s)...",
                  file=sys.stderr, flush=True)
        started = time.perf_counter()
        here = Path(__file__).parent
        cpp_extension.load(
            name=_LIBRARY, sources=[str(here / name) for name in _SOURCES],
            build_directory=str(build), is_python_module=False, verbose=False,
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"])
        seconds = time.perf_counter() - started
        if fresh:
            print(f"meshserve: CPU attention kernel built in {seconds:.0f} s ({build})",
                  file=sys.stderr, flush=True)
        logger.info("CPU kernels loaded from %s in %.1fs", build, seconds)
        _loaded = True
