"""Where the runner's tensors live: eager torch on the CPU, or torch_xla (TPU, or PJRT CPU).

The runner asks the backend: which device to put tensors on, how to place a tensor there (whole,
or split over the mesh), whether shapes must be static (xla pads every step to a bucket; cpu
compiles one program for every size), which torch.compile backend compiles its pieces (openxla or
inductor), which dtype the device computes natively (``dtype="auto"``), and how to end an eager
piece on xla (``sync`` cuts the lazy XLA graph traced so far and runs it). Only this module starts
torch_xla's runtime; the one other torch_xla import is the Pallas kernel in
``runner/attention/pallas.py``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from meshserve.config import ParallelConfig
from meshserve.spmd.mesh import build_mesh
from meshserve.spmd.sharding import PartitionSpec

if TYPE_CHECKING:
    from torch_xla.distributed.spmd import Mesh

logger = logging.getLogger("meshserve.backend")


@dataclass(frozen=True)
class Backend:
    name: str  # "cpu" or "xla"
    device: torch.device
    static_shapes: bool
    on_tpu: bool = False
    mesh: "Mesh | None" = None  # set when the replica spans several devices (SPMD)

    def __post_init__(self) -> None:
        # The mesh as torch_xla's sharding ops take it in a traced graph: a plain string, made
        # here because dynamo cannot trace str(mesh).
        object.__setattr__(self, "mesh_text", None if self.mesh is None else str(self.mesh))

    @property
    def compile_backend(self) -> str:
        """torch.compile's backend for this device: openxla lowers to XLA, inductor to C++."""
        return "openxla" if self.name == "xla" else "inductor"

    def compile_options(self, dtype: torch.dtype) -> dict[str, bool | str] | None:
        """inductor's options for the runner's compiled pieces (None on xla)."""
        if self.name == "xla":
            return None
        # Freezing turns the weights into constants of the compiled program, so inductor folds
        # their transposes once and prepacks every linear layer's weight. CompiledPiece applies
        # the options for the whole capture: dynamo reads the freezing flag too.
        options: dict[str, bool | str] = {"freezing": True}
        if self.generates_gemms(dtype):
            # bf16 on AMX: every linear layer becomes inductor's own C++ GEMM on AMX tiles,
            # generated for these weights, instead of a oneDNN call. oneDNN serves a decode's
            # few rows at 12-17 GB/s of weights; the generated GEMMs made decode steps 11%
            # faster and the 64x64 workload 13% (2-core Xeon, SmolLM2-135M), prompts alike, for
            # ~20 s more warm-up. With "CPP" the only choice nothing is timed, so the kernel,
            # and every row's arithmetic, is the same on every start and for every batch size
            # (one dynamic program serves them all).
            options.update(max_autotune=True, max_autotune_gemm_backends="CPP")
        return options

    def generates_gemms(self, dtype: torch.dtype) -> bool:
        """Whether the compiled linear layers are inductor's own C++ GEMMs (bf16 on a CPU with
        AMX tiles), which compute a pointwise op that follows them in their epilogue."""
        return (self.name == "cpu" and dtype == torch.bfloat16
                and torch._C._cpu._is_amx_tile_supported())

    @property
    def default_token_budget(self) -> int:
        """``max_num_batched_tokens`` when unset. A CPU step costs about the same per token
        whether it is a prompt's or a decode's, so a larger budget finishes a burst of prompts in
        fewer steps that each hold every running decode back once: on a 2-core EPYC (fp32,
        32 streams) 2048 gave TPOT p50 186 ms against 246-258 ms at 1024, for a first token
        about 3 s later. XLA compiles one program per token bucket at warm-up, so it keeps to
        1024 (vLLM's defaults: 2048 for its CPU server, 1024 for a TPU v6e server)."""
        return 1024 if self.name == "xla" else 2048

    def auto_dtype(self) -> tuple[torch.dtype, str]:
        """The dtype this device computes natively, and why (``dtype="auto"``)."""
        if self.on_tpu:
            return torch.bfloat16, "TPUs compute in bfloat16"
        if self.name == "xla":
            return torch.float32, "XLA:CPU computes in float32"
        flags = native_bf16_flags()
        if flags:
            return torch.bfloat16, f"the CPU has native bfloat16 matrix instructions ({flags})"
        return torch.float32, ("the CPU has no native bfloat16 matrix instructions "
                               "(AVX512-BF16 or AMX), so bfloat16 would be emulated")

    def sync(self) -> None:
        if self.name == "xla":
            import torch_xla

            torch_xla.sync()

    def to_device(self, tensor: torch.Tensor, spec: PartitionSpec | None = None) -> torch.Tensor:
        """Copy a CPU tensor over, split by ``spec`` when there is a mesh, else whole.

        On a mesh a whole tensor is marked replicated, not left unannotated: a compiled piece
        records its inputs' shardings at warm-up, and torch_xla's dynamo bridge re-traces any
        call whose inputs differ from them (an unannotated tensor differs from a replicated one).
        """
        if self.mesh is None:
            return tensor.to(self.device)
        spec = spec or (None,) * tensor.ndim
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.spmd as xs

        if tensor.ndim > 1:
            # Sent shard by shard: a whole copy of a large weight never lands on every device.
            return xm.send_cpu_data_to_device(tensor, self.device,
                                              input_sharding=xs.ShardingSpec(self.mesh, spec))[0]
        # torch_xla 2.9's ShardingSpec fails on 1-D tensors; those are small (biases, step
        # inputs), so they are copied whole and then re-split.
        placed = tensor.to(self.device)
        xs.mark_sharding(placed, self.mesh, spec)
        return placed

    def free_memory(self) -> int:
        """Bytes free where the KV cache will live: a TPU chip's HBM (torch_xla's memory info),
        else the host's available RAM (the cpu backend, and XLA on the PJRT CPU client)."""
        if self.on_tpu:
            import torch_xla.core.xla_model as xm

            info = xm.get_memory_info(self.device)
            return int(info["bytes_limit"] - info["bytes_used"])
        import psutil

        return int(psutil.virtual_memory().available)

    def donate(self, tensors: list[torch.Tensor]) -> None:
        """Let XLA reuse these tensors' buffers for the outputs of the next program that takes
        them (the KV cache, updated out of place each step, without a second copy)."""
        if self.name != "xla":
            return
        import torch_xla

        for tensor in tensors:
            torch_xla._XLAC._set_buffer_donation(tensor, True)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype,
              spec: PartitionSpec | None = None) -> torch.Tensor:
        """A zero tensor created on the device (no host copy), split by ``spec`` on a mesh."""
        tensor = torch.zeros(shape, dtype=dtype, device=self.device)
        if self.mesh is not None and spec is not None:
            import torch_xla.distributed.spmd as xs

            xs.mark_sharding(tensor, self.mesh, spec)
        return tensor

    def replicate(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` whole on every device (an all-gather where it was split).

        torch_xla's ``aot_mark_sharding`` op rather than ``mark_sharding``: it returns an annotated
        copy, which dynamo can trace into a compiled piece (``mark_sharding`` cannot be traced).
        """
        if self.mesh is None:
            return tensor
        import torch_xla.distributed.spmd  # noqa: F401 - registers torch.ops.xla.aot_mark_sharding

        return torch.ops.xla.aot_mark_sharding(tensor, self.mesh_text, str((None,) * tensor.ndim))

    def num_compiled_graphs(self) -> int:
        """Graphs in torch_xla's compilation cache (0 on the eager backend)."""
        if self.name != "xla":
            return 0
        import torch_xla.runtime as xr

        return xr.get_num_cached_compilation_graph()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where there is no procfs)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f
                                   if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def native_bf16_flags() -> str:
    """The CPU's native bf16 matrix instruction sets, as /proc/cpuinfo names them ("" if none)."""
    flags = cpu_flags()
    return ", ".join(f for f in ("amx_bf16", "avx512_bf16") if f in flags)


def tpu_present() -> bool:
    """True on a TPU VM or GKE TPU node: libtpu or the TPU runtime environment is there."""
    if os.environ.get("PJRT_DEVICE", "").upper() == "TPU":
        return True
    if os.environ.get("TPU_ACCELERATOR_TYPE") or os.environ.get("TPU_WORKER_ID") is not None:
        return os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0")
    return False


def resolve_device(device: str) -> str:
    """``auto`` picks xla on a TPU host and cpu elsewhere."""
    if device == "auto":
        return "xla" if tpu_present() else "cpu"
    if device not in ("cpu", "xla"):
        raise ValueError(f"device: {device!r} is not one of auto, cpu, xla")
    return device


def create_backend(device: str, parallel: ParallelConfig | None = None,
                   compile_cache_dir: str | None = None) -> Backend:
    parallel = parallel or ParallelConfig()
    name = resolve_device(device)
    if name == "cpu":
        if parallel.world_size > 1:
            raise ValueError(
                f"tensor_parallel_size x data_parallel_size = {parallel.world_size} needs "
                "device='xla'; the cpu backend runs one unsharded model")
        if compile_cache_dir is not None:
            _use_cpu_compile_cache(compile_cache_dir)
        if not tpu_present():
            # The device torch_xla would pick here anyway. Libraries the loader imports
            # (transformers, through accelerate) import torch_xla, which otherwise picks it
            # itself and says so with a warning on the root logger, configuring that logger.
            os.environ.setdefault("PJRT_DEVICE", "CPU")
        return Backend("cpu", torch.device("cpu"), static_shapes=False)
    return _create_xla_backend(parallel, compile_cache_dir)


def _use_cpu_compile_cache(path: str) -> None:
    """Inductor's caches (FX graphs, generated C++) and meshserve's kernel builds under ``path``,
    so a restart finds everything it compiled before."""
    path = os.path.abspath(path)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(path, "inductor")
    os.environ["MESHSERVE_KERNEL_CACHE"] = os.path.join(path, "kernels")
    logger.info("cpu compilation caches under %s", path)


def _create_xla_backend(parallel: ParallelConfig, compile_cache_dir: str | None) -> Backend:
    import torch_xla
    import torch_xla.runtime as xr

    if compile_cache_dir is not None:
        _initialize_compile_cache(compile_cache_dir)
    if parallel.world_size > 1:
        # Before any tensor exists: SPMD turns the devices into one virtual device.
        xr.use_spmd()
    mesh = build_mesh(parallel, xr.global_runtime_device_count())
    on_tpu = xr.device_type() == "TPU"
    return Backend("xla", torch_xla.device(), static_shapes=True, on_tpu=on_tpu, mesh=mesh)


def _initialize_compile_cache(path: str) -> None:
    """Point torch_xla's persistent compilation cache at ``path`` (once per process).

    It must happen before the first computation; a second engine in the same process may ask for
    the same folder again, but not for another one.
    """
    import torch_xla
    import torch_xla.runtime as xr

    path = os.path.abspath(path)
    if torch_xla._XLAC._xla_computation_cache_is_initialized():
        current = os.environ.get("XLA_PERSISTENT_CACHE_PATH")
        if current != path:
            raise RuntimeError(
                f"compile_cache_dir: {path!r} requested after torch_xla started computing with "
                f"{'no persistent cache' if current is None else repr(current)}; set it before "
                "the first engine of the process starts")
        return
    os.makedirs(path, exist_ok=True)
    xr.initialize_cache(path, readonly=False)
    logger.info("persistent XLA compilation cache at %s", path)
