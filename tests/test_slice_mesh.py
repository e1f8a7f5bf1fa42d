"""A TPU slice's whole program in one process: a 2-host x 4-chip mesh over 8 PJRT CPU devices.

``MESHSERVE_EMULATED_HOSTS=2`` with ``CPU_NUM_DEVICES=8`` makes the 8 virtual devices stand for two
hosts of four chips, with ordinals dealt round-robin over the hosts (as a multi-host runtime need
not number a host's chips together). The mesh must list them host by host, in topology order;
every weight and KV cache tensor must be split over that order; and greedy tokens must equal the
eager cpu engine's. The child process runs this module (``python -m tests.test_slice_mesh``)
because the device count is fixed when torch_xla starts.
"""

from __future__ import annotations

import json
import math
import re
import sys

import numpy as np
import pytest

from meshserve.spmd.mesh import (DATA_AXIS, EMULATED_HOSTS_ENV, MODEL_AXIS, Device,
                                 emulated_devices, topology_order)
from meshserve.spmd.sharding import KV_CACHE_SPEC, weight_spec
from tests.xla_child import run_xla_child

ENGINE = dict(dtype="float32", max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256,
              num_kv_blocks=96)
MAX_TOKENS = 12
HOSTS, CHIPS = 2, 4
# Host 0 holds ordinals 0, 2, 4, 6 and host 1 the odd ones: the mesh lists host 0's chips first.
SLICE_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def prompts() -> list[list[int]]:
    """Short decodes beside prefills that the 64-token budget chunks."""
    rng = np.random.default_rng(5)
    return [rng.integers(100, 40000, size=n).tolist() for n in (1, 9, 30, 70, 110)]


# --- Plain data: the order ---------------------------------------------------------------------


def test_topology_order_follows_coordinates_not_ordinals() -> None:
    # A v4-16-like slice: two hosts of 2x2 chips, host 1 at z=1, ordinals scattered.
    coords = [(0, 0, 1), (1, 0, 0), (0, 1, 0), (1, 1, 1), (0, 0, 0), (1, 0, 1), (0, 1, 1),
              (1, 1, 0)]
    devices = [Device(ordinal, c) for ordinal, c in enumerate(coords)]
    assert topology_order(devices) == [4, 1, 2, 7, 0, 5, 6, 3]
    two_cores = [Device(0, (0, 0, 0), core=1), Device(1, (0, 0, 0), core=0)]
    assert topology_order(two_cores) == [1, 0]


def test_emulated_hosts_hold_interleaved_ordinals() -> None:
    assert topology_order(emulated_devices(8, 2)) == SLICE_ORDER
    assert topology_order(emulated_devices(8, 1)) == list(range(8))  # one host: ordinal order
    with pytest.raises(ValueError, match=f"{EMULATED_HOSTS_ENV}: 3 hosts do not split .* 8"):
        emulated_devices(8, 3)


# --- The child: one engine over the emulated slice -----------------------------------------------


def _child_job(job: dict) -> dict:
    import torch_xla

    from meshserve import LLM, SamplingParams

    llm = LLM(job["model"], device="xla", tensor_parallel_size=job["tp"],
              data_parallel_size=job["dp"], **ENGINE)
    runner = llm.engine.runner
    spec = torch_xla._XLAC._get_xla_sharding_spec
    outs = llm.generate(job["prompts"], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    mesh = runner.backend.mesh
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "mesh": mesh.get_logical_mesh().tolist(),
        "weights": {name: [p.ndim, spec(p)] for name, p in runner.model.named_parameters()},
        "kv_cache": [spec(t) for layer in runner.kv_caches for t in layer],
    }


def _child_main() -> None:
    import torch_xla.debug.metrics as met

    results = [_child_job(job) for job in json.loads(sys.stdin.read())]
    print(json.dumps({"results": results, "fallback_ops": met.executed_fallback_ops()}))


# --- The parent ----------------------------------------------------------------------------------


def parse_sharding(text: str) -> tuple[list[int], list[int]]:
    """An HLO sharding string's tile shape and its devices in tile order ([] for replicated)."""
    if text in ("", "{replicated}"):
        return [], []
    match = re.match(r"\{devices=\[([\d,]+)\]([\d,]+)", text)
    assert match, text
    return [int(d) for d in match[1].split(",")], [int(d) for d in match[2].split(",")]


def expected_sharding(mesh: np.ndarray, spec: tuple) -> tuple[list[int], list[int]]:
    """What ``mark_sharding(t, mesh, spec)`` must record: a tile per mesh position, the axes the
    spec uses first and the rest (replicas) last, each over the mesh's own device order."""
    axes = (DATA_AXIS, MODEL_AXIS)
    used = [a for a in spec if a is not None]
    if not used:
        return [], []
    rest = [a for a in axes if a not in used and mesh.shape[axes.index(a)] > 1]
    tiles = [mesh.shape[axes.index(a)] if a else 1 for a in spec]
    tiles += [math.prod(mesh.shape[axes.index(a)] for a in rest)] if rest else []
    order = [axes.index(a) for a in used] + [axes.index(a) for a in axes if a not in used]
    return tiles, mesh.transpose(order).flatten().tolist()


def run_slice(jobs: list[dict]) -> dict:
    return run_xla_child("tests.test_slice_mesh", HOSTS * CHIPS, jobs, timeout=900,
                         env={EMULATED_HOSTS_ENV: str(HOSTS)})


def eager_tokens(model: str) -> list[list[int]]:
    from meshserve import LLM, SamplingParams

    llm = LLM(model, device="cpu", **ENGINE)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS))]


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.test_xla_engine import build_wide_llama  # 8 query heads: tensor parallel 8

    return build_wide_llama(str(tmp_path_factory.mktemp("wide-llama")))


@pytest.fixture(scope="module")
def emulated_slice(tiny_llama_dir: str, wide_llama_dir: str) -> list[dict]:
    return run_slice([
        # Hosts on the data axis, each host's four chips on the model axis.
        {"model": tiny_llama_dir, "tp": CHIPS, "dp": HOSTS, "prompts": prompts()},
        # One model over every chip of the slice, as the multi-host manifests serve it.
        {"model": wide_llama_dir, "tp": HOSTS * CHIPS, "dp": 1, "prompts": prompts()},
    ])["results"]


def assert_split_over_mesh(result: dict) -> None:
    mesh = np.array(result["mesh"])
    for name, (ndim, text) in result["weights"].items():
        assert parse_sharding(text) == expected_sharding(mesh, weight_spec(name, ndim)), name
    kv = expected_sharding(mesh, KV_CACHE_SPEC)
    assert kv[0] and all(parse_sharding(text) == kv for text in result["kv_cache"])


@pytest.mark.slow
def test_two_hosts_of_four_chips_on_data_and_model_axes(emulated_slice, tiny_llama_dir) -> None:
    result = emulated_slice[0]
    assert result["mesh"] == [SLICE_ORDER[:CHIPS], SLICE_ORDER[CHIPS:]]  # a row per host
    assert_split_over_mesh(result)
    assert result["tokens"] == eager_tokens(tiny_llama_dir)


@pytest.mark.slow
def test_one_model_over_every_chip_of_the_slice(emulated_slice, wide_llama_dir) -> None:
    result = emulated_slice[1]
    assert result["mesh"] == [SLICE_ORDER]
    assert_split_over_mesh(result)
    q_proj = result["weights"]["model.layers.0.self_attn.q_proj.weight"][1]
    assert parse_sharding(q_proj) == ([8, 1], SLICE_ORDER)  # column-parallel over both hosts
    assert result["tokens"] == eager_tokens(wide_llama_dir)


if __name__ == "__main__":
    _child_main()
