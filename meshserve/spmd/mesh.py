"""The device mesh of one replica: every device of its slice, in the slice's physical order.

Two axes, named for what they split: ``data`` (the tokens of a step) and ``model`` (weights and
KV heads, the Megatron split). XLA's SPMD partitioner needs a mesh over every device the runtime
sees, so ``data_parallel_size x tensor_parallel_size`` must equal that count; on a multi-host TPU
slice that is every chip of every host (``global_runtime_device_count``), and every host builds
the same mesh. A replica of one device needs no mesh at all.

A device's id is its global ordinal, and ordinals need not run host by host or along the chips'
links, so the mesh lists the devices by their physical coordinates (``topology_order``): the
model axis runs along neighbouring chips, and with a data axis each row of the mesh is one compact
block of the slice (on a slice of 4-chip hosts and ``tensor_parallel_size`` 4, one host).
torch_xla's ``HybridMesh`` does the same from the same attributes, but only on a TPU; this order
runs the same code on PJRT CPU, where it is tested.

On PJRT CPU a device has no coordinates. With ``MESHSERVE_EMULATED_HOSTS=H`` (and
``CPU_NUM_DEVICES = H x chips``) one process stands for a whole slice of H hosts: host h's chips
sit in a row at ``z = h``, and their ordinals are dealt round-robin over the hosts, so that ordinal
order is not topology order here either. The mesh, the shardings and the compiled program are
then the slice's; only the collectives stay inside one process. Without the variable the CPU
devices form one host in ordinal order.

The lead host of a multi-host replica is the slice's process 0 (``process_position``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from meshserve.config import ParallelConfig

if TYPE_CHECKING:
    from torch_xla.distributed.spmd import Mesh

DATA_AXIS = "data"
MODEL_AXIS = "model"
EMULATED_HOSTS_ENV = "MESHSERVE_EMULATED_HOSTS"


@dataclass(frozen=True, slots=True)
class Device:
    """One device of the slice, as the runtime describes it."""

    ordinal: int  # the global id a mesh lists
    coords: tuple[int, int, int]  # chip position in the slice (x, y, z)
    core: int = 0  # core on the chip, where a chip shows more than one device


def topology_order(devices: list[Device]) -> list[int]:
    """The ordinals in physical order: z slowest, then y, then x, then the core on the chip."""
    return [d.ordinal for d in sorted(devices, key=lambda d: (d.coords[::-1], d.core))]


def emulated_devices(count: int, hosts: int) -> list[Device]:
    """PJRT CPU devices standing for ``hosts`` hosts of ``count / hosts`` chips each."""
    if hosts < 1 or count % hosts:
        raise ValueError(f"{EMULATED_HOSTS_ENV}: {hosts} hosts do not split the runtime's "
                         f"{count} devices evenly; set CPU_NUM_DEVICES to hosts x chips")
    return [Device(d, (d // hosts, 0, d % hosts)) for d in range(count)]


def _ordinal(name: str) -> int:
    return int(name.rsplit(":", 1)[1])  # "TPU:5" -> 5


def runtime_devices() -> list[Device]:
    """Every device of the slice: torch_xla's attributes on TPU, an emulated slice on PJRT CPU."""
    import torch_xla.runtime as xr

    attributes = xr.global_runtime_device_attributes()
    if all("coords" in a for a in attributes):
        return [Device(_ordinal(a["name"]), tuple(a["coords"]), int(a.get("core_on_chip", 0)))
                for a in attributes]
    hosts = int(os.environ.get(EMULATED_HOSTS_ENV, "1"))
    return emulated_devices(len(attributes), hosts)


def build_mesh(parallel: ParallelConfig, num_devices: int) -> "Mesh | None":
    """A ``(data, model)`` mesh over the slice's ``num_devices`` devices in topology order, or
    None for a single-device replica."""
    if parallel.world_size == 1:
        return None
    if parallel.world_size != num_devices:
        raise ValueError(
            f"tensor_parallel_size x data_parallel_size: {parallel.tensor_parallel_size} x "
            f"{parallel.data_parallel_size} = {parallel.world_size}, but the XLA runtime has "
            f"{num_devices} devices; SPMD needs a mesh over all of them (on a multi-host slice: "
            "every chip of every host)")
    from torch_xla.distributed.spmd import Mesh

    devices = runtime_devices()
    if sorted(d.ordinal for d in devices) != list(range(num_devices)):
        raise RuntimeError(f"the runtime describes devices {sorted(d.ordinal for d in devices)}, "
                           f"not the ordinals 0..{num_devices - 1} of its device count")
    shape = (parallel.data_parallel_size, parallel.tensor_parallel_size)
    return Mesh(np.array(topology_order(devices)), shape, (DATA_AXIS, MODEL_AXIS))


def axis_size(mesh: "Mesh | None", axis: str) -> int:
    return 1 if mesh is None else int(mesh.shape()[axis])


def process_position(backend_name: str) -> tuple[int, int]:
    """(this process's index in the slice, the slice's process count); ``(0, 1)`` off XLA.

    On a multi-host TPU slice every host runs one process; the one with index 0 must be the
    replica's lead. On PJRT CPU every process is a runtime of its own.
    """
    if backend_name != "xla":
        return 0, 1
    import torch_xla.runtime as xr

    return xr.process_index(), xr.process_count()
