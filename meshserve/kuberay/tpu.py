"""GKE's TPU offer: generations, slice topologies and the VM shapes that hold them.

Sources: the Cloud TPU pages "TPU v5e" and "TPU v6e" (2D topologies, VMs per slice, GKE machine
types), GKE's "Plan TPUs in GKE" (node label values, the 3D shapes of v4 and v5p) and Compute
Engine's machine type listings (vCPUs and memory, used only to size pod requests). GKE labels
TPU nodes with cloud.google.com/gke-tpu-accelerator and cloud.google.com/gke-tpu-topology.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MachineType:
    """A GKE TPU VM shape: how many chips one Kubernetes node (one pod) owns."""

    name: str
    chips: int
    vcpus: int
    memory_gib: int


@dataclass(frozen=True, slots=True)
class TpuGeneration:
    """One TPU generation as GKE offers it: single-host shapes and multi-host slices."""

    name: str
    gke_accelerator: str
    # topology -> the machine type that holds the whole slice on one VM.
    single_host: tuple[tuple[str, MachineType], ...]
    # Multi-host slices are built from 4-chip VMs of this type.
    multi_host_machine: MachineType
    multi_host_topologies: tuple[str, ...]

    @property
    def topologies(self) -> tuple[str, ...]:
        return tuple(t for t, _ in self.single_host) + self.multi_host_topologies


_CT5LP_1T = MachineType("ct5lp-hightpu-1t", chips=1, vcpus=24, memory_gib=48)
_CT5LP_4T = MachineType("ct5lp-hightpu-4t", chips=4, vcpus=112, memory_gib=192)
_CT5LP_8T = MachineType("ct5lp-hightpu-8t", chips=8, vcpus=224, memory_gib=384)
_CT6E_1T = MachineType("ct6e-standard-1t", chips=1, vcpus=44, memory_gib=176)
_CT6E_4T = MachineType("ct6e-standard-4t", chips=4, vcpus=180, memory_gib=720)
_CT6E_8T = MachineType("ct6e-standard-8t", chips=8, vcpus=180, memory_gib=1440)
_CT5P_4T = MachineType("ct5p-hightpu-4t", chips=4, vcpus=208, memory_gib=448)
_CT4P_4T = MachineType("ct4p-hightpu-4t", chips=4, vcpus=240, memory_gib=407)

# v5e and v6e also come as 2x4 on two 4-chip VMs; the renderer always takes the one 8-chip VM,
# which keeps a tensor-parallel group on one host. 3D shapes stop at 8x8x8 (128 hosts): bigger
# slices exist for training but are far past what one serving replica needs.
_PLANAR_MULTI_HOST = ("4x4", "4x8", "8x8", "8x16", "16x16")
_CUBIC_MULTI_HOST = ("2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8")

GENERATIONS: dict[str, TpuGeneration] = {
    g.name: g
    for g in (
        TpuGeneration("v4", "tpu-v4-podslice", (("2x2x1", _CT4P_4T),), _CT4P_4T,
                      _CUBIC_MULTI_HOST),
        TpuGeneration("v5e", "tpu-v5-lite-podslice",
                      (("1x1", _CT5LP_1T), ("2x2", _CT5LP_4T), ("2x4", _CT5LP_8T)), _CT5LP_4T,
                      _PLANAR_MULTI_HOST),
        TpuGeneration("v5p", "tpu-v5p-slice", (("2x2x1", _CT5P_4T),), _CT5P_4T,
                      _CUBIC_MULTI_HOST),
        TpuGeneration("v6e", "tpu-v6e-slice",
                      (("1x1", _CT6E_1T), ("2x2", _CT6E_4T), ("2x4", _CT6E_8T)), _CT6E_4T,
                      _PLANAR_MULTI_HOST),
    )
}


@dataclass(frozen=True, slots=True)
class TpuSlice:
    """A supported (generation, topology) pair and the machine type GKE builds it from."""

    generation: TpuGeneration
    topology: str
    machine: MachineType

    @property
    def chips(self) -> int:
        return math.prod(int(d) for d in self.topology.split("x"))

    @property
    def hosts(self) -> int:
        return self.chips // self.machine.chips


def resolve_slice(accelerator: str, topology: str) -> TpuSlice:
    """The slice for ``accelerator`` and ``topology``; ``ValueError`` names the valid choices."""
    generation = GENERATIONS.get(accelerator)
    if generation is None:
        raise ValueError(f"accelerator: {accelerator!r} is not supported; "
                         f"choose one of {', '.join(GENERATIONS)}")
    for single_topology, machine in generation.single_host:
        if topology == single_topology:
            return TpuSlice(generation, topology, machine)
    if topology in generation.multi_host_topologies:
        return TpuSlice(generation, topology, generation.multi_host_machine)
    raise ValueError(f"topology: TPU {accelerator} has no {topology!r} slice on GKE; valid "
                     f"topologies: {', '.join(generation.topologies)}")
