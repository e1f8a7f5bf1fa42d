"""Which CPUs of a host its engine computes on, and which it leaves to the serving processes.

An engine's OpenMP team works in parallel regions that end at a barrier, so a thread of the team
that another process preempts holds up the whole team. Around the engine run the serving
processes (the ingress, Ray's daemons, the Serve replicas): small, frequent work that wakes on
whatever core it last ran on. ``reserved_cpus`` takes the first CPUs of the host away from the
engine; the kernel then wakes that work on the reserved CPUs, which are idle, and the engine's
threads run undisturbed on the rest.
"""

from __future__ import annotations

import os


def split_cpus(reserved_cpus: int, allowed: set[int] | None = None) -> tuple[int, ...]:
    """The CPUs the engine keeps out of ``allowed`` (default: the CPUs this process may use):
    all but the first ``reserved_cpus``. Raises ``ValueError`` when that leaves none."""
    cpus = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    if not isinstance(reserved_cpus, int) or not 0 <= reserved_cpus < len(cpus):
        raise ValueError(f"reserved_cpus: must be an integer from 0 to {len(cpus) - 1} on this "
                         f"host ({len(cpus)} CPUs), got {reserved_cpus!r}")
    return tuple(cpus[reserved_cpus:])


def claim_engine_cpus(reserved_cpus: int = 0) -> tuple[int, ...]:
    """Give the calling thread, the one that steps the engine, its CPUs (``split_cpus``) and one
    torch thread per CPU; returns them.

    With none reserved the thread keeps its affinity. With some reserved it is pinned, and the
    OpenMP team it starts later inherits the pin (a thread starts with its creator's affinity), so
    call this before the engine's first parallel region, on the thread that will step it.
    """
    import torch

    cpus = split_cpus(reserved_cpus)
    if reserved_cpus:
        os.sched_setaffinity(0, cpus)  # pid 0: this thread alone
    # Ray sets OMP_NUM_THREADS to the actor's CPU count; the engine wants every core it owns.
    # (torch applies this count to threads started later too, such as the engine thread.)
    torch.set_num_threads(len(cpus))
    return cpus
