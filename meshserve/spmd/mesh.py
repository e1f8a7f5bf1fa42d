"""The device mesh of one replica, built from the parallel config.

Two axes, named for what they split: ``data`` (the tokens of a step) and ``model`` (weights and
KV heads, the Megatron split). XLA's SPMD partitioner needs a mesh over every device the runtime
sees, so ``data_parallel_size x tensor_parallel_size`` must equal that count; a replica of one
device needs no mesh at all (and runs on one chip, or replicated under SPMD).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from meshserve.config import ParallelConfig

if TYPE_CHECKING:
    from torch_xla.distributed.spmd import Mesh

DATA_AXIS = "data"
MODEL_AXIS = "model"


def build_mesh(parallel: ParallelConfig, num_devices: int) -> "Mesh | None":
    """A ``(data, model)`` mesh over ``num_devices``, or None for a single-device replica.

    Devices are laid out row-major, so the model axis runs over neighbouring device ids: on a TPU
    host those are the chips joined by the fastest links.
    """
    if parallel.world_size == 1:
        return None
    if parallel.world_size != num_devices:
        raise ValueError(
            f"tensor_parallel_size x data_parallel_size: {parallel.tensor_parallel_size} x "
            f"{parallel.data_parallel_size} = {parallel.world_size}, but the XLA runtime has "
            f"{num_devices} devices; SPMD needs a mesh over all of them")
    from torch_xla.distributed.spmd import Mesh

    shape = (parallel.data_parallel_size, parallel.tensor_parallel_size)
    return Mesh(np.arange(num_devices), shape, (DATA_AXIS, MODEL_AXIS))


def axis_size(mesh: "Mesh | None", axis: str) -> int:
    return 1 if mesh is None else int(mesh.shape()[axis])
