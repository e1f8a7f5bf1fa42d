"""The cpu backend's C++ paged attention kernel against the pure-torch reference.

Mixed steps (chunked prefills over cached context, decodes, idle sequences) with lengths at and
around block boundaries, grouped-query heads, sliding windows, the kernel's register-tiled path and
its generic path (head and block sizes that are not multiples of 16), fp32 to 1e-5. The cache is
written in place, and a compiled forward never takes it as an input.
"""

from __future__ import annotations

import pytest
import torch

from meshserve.runner.attention import PagedCpuAttention, StepLayout
from meshserve.runner.kernels import ops
from meshserve.spmd.backend import cpu_flags
from tests.paged_reference import mixed_step, reference_paged_attention


def to_kernel_layout(k_logical: torch.Tensor, v_logical: torch.Tensor):
    """Logical [N, B, Hkv, D] caches as the kernel keeps them: keys [N, Hkv, D, B], values
    [N, Hkv, B, D], each block paired in memory where the kernel pairs this dtype and shape."""
    keys, values = k_logical.permute(0, 2, 3, 1), v_logical.permute(0, 2, 1, 3)
    if paired(k_logical):
        return pair_rows(keys).view(keys.shape), pair_rows(values).view(values.shape)
    return keys.contiguous(), values.contiguous()


def from_kernel_layout(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """The kernel's caches back in the logical [N, B, Hkv, D] layout."""
    if paired(k_cache.permute(0, 3, 1, 2)):
        k_cache, v_cache = unpair_rows(k_cache), unpair_rows(v_cache)
    return k_cache.permute(0, 3, 1, 2), v_cache.permute(0, 2, 1, 3)


def paired(logical: torch.Tensor) -> bool:
    _, block_size, _, head_dim = logical.shape
    return ops.paired_blocks(logical.dtype, head_dim, block_size)


def pair_rows(blocks: torch.Tensor) -> torch.Tensor:
    """[..., R, C] -> [..., R / 2, C, 2]: rows 2j and 2j + 1 interleaved."""
    *lead, rows, cols = blocks.shape
    return blocks.reshape(*lead, rows // 2, 2, cols).transpose(-1, -2).contiguous()


def unpair_rows(paired_blocks: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pair_rows``, read from a cache whose shape is still [..., R, C]."""
    *lead, rows, cols = paired_blocks.shape
    pairs = paired_blocks.view(*lead, rows // 2, cols, 2)
    return pairs.transpose(-1, -2).reshape(*lead, rows, cols)


def run_kernel(layout: StepLayout, q, k, v, k_cache, v_cache, scale: float, window: int | None):
    impl = PagedCpuAttention(window)
    cache_id = impl.bind_cache((k_cache, v_cache))
    meta = impl.metadata(layout, lambda array, token_major: torch.from_numpy(array))
    out, same = impl.forward(q, k, v, cache_id, meta, scale)
    assert same == cache_id  # written in place: the layer keeps its cache
    return out


STEPS = [
    # decodes at and around block boundaries (block 16)
    ([1] * 8, [1, 15, 16, 17, 31, 32, 33, 100]),
    # chunked prefills over cached context beside decodes, and an idle sequence (0 tokens)
    ([5, 1, 40, 0, 1, 17], [5, 20, 40, 9, 200, 33]),
    # a prefill chunk that starts mid-block and ends on a boundary, a 1-token prefill
    ([16, 33, 1], [48, 33, 1]),
]


@pytest.mark.parametrize("q_lens, seq_lens", STEPS)
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 2, 64), (9, 3, 64), (4, 4, 16)])
def test_kernel_equals_reference_fp32(q_lens, seq_lens, window, heads, kv_heads, dim) -> None:
    layout, q, k, v, k_hist, v_hist = mixed_step(q_lens, seq_lens, block=16, blocks=64,
                                                 heads=heads, kv_heads=kv_heads, dim=dim,
                                                 dtype=torch.float32)
    want, want_k, want_v = reference_paged_attention(q, k, v, k_hist, v_hist, layout, 0.125,
                                                     window)
    k_cache, v_cache = to_kernel_layout(k_hist, v_hist)
    got = run_kernel(layout, q, k, v, k_cache, v_cache, 0.125, window)
    n = layout.num_tokens
    torch.testing.assert_close(got[:n], want[:n], rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(got[n:]) == 0  # padding tokens attend to nothing
    got_k, got_v = from_kernel_layout(k_cache, v_cache)
    # Written in place, exactly; block 0 is the null block, which padding tokens write into.
    torch.testing.assert_close(got_k[1:], want_k[1:], rtol=0, atol=0)
    torch.testing.assert_close(got_v[1:], want_v[1:], rtol=0, atol=0)


@pytest.mark.parametrize("block, dim", [(8, 16), (32, 64), (16, 80)])
def test_generic_shapes_equal_reference(block: int, dim: int) -> None:
    """Block and head sizes outside the register-tiled path (not multiples of 16) take the
    kernel's generic loop; the answer is the same."""
    layout, q, k, v, k_hist, v_hist = mixed_step([3, 1, 9], [3, 2 * block + 1, 9], block=block,
                                                 blocks=32, heads=4, kv_heads=2, dim=dim,
                                                 dtype=torch.float32, seed=3)
    want, _, _ = reference_paged_attention(q, k, v, k_hist, v_hist, layout, dim ** -0.5, None)
    k_cache, v_cache = to_kernel_layout(k_hist, v_hist)
    got = run_kernel(layout, q, k, v, k_cache, v_cache, dim ** -0.5, None)
    n = layout.num_tokens
    torch.testing.assert_close(got[:n], want[:n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_lens, seq_lens", STEPS)
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("dim, block", [(64, 16), (96, 16), (64, 32)])
def test_bfloat16_cache_is_written_and_read_in_place(q_lens, seq_lens, window, dim,
                                                     block) -> None:
    """bf16 takes the AMX tiles or AVX-512 BF16 pair products (and a paired cache) where the CPU
    has them, fp32 arithmetic elsewhere; either way it agrees with the float64 reference to bf16's
    precision. Both paired arithmetics sum values 64 head dimensions at a time: 96 leaves 32 for
    the last pass; blocks of 32 keys take two vectors of scores each."""
    layout, q, k, v, k_hist, v_hist = mixed_step(q_lens, seq_lens, block=block, blocks=64, heads=8,
                                                 kv_heads=2, dim=dim, dtype=torch.bfloat16)
    want, want_k, want_v = reference_paged_attention(q, k, v, k_hist, v_hist, layout, 0.125,
                                                     window)
    k_cache, v_cache = to_kernel_layout(k_hist, v_hist)
    got = run_kernel(layout, q, k, v, k_cache, v_cache, 0.125, window)
    n = layout.num_tokens
    # The reference rounds its float64 result once; the kernel its fp32 sums (and, on paired
    # blocks, the probabilities it multiplies the values by).
    torch.testing.assert_close(got[:n].float(), want[:n].float(), rtol=2e-2, atol=2e-2)
    assert torch.count_nonzero(got[n:]) == 0
    got_k, got_v = from_kernel_layout(k_cache, v_cache)
    torch.testing.assert_close(got_k[1:], want_k[1:], rtol=0, atol=0)
    torch.testing.assert_close(got_v[1:], want_v[1:], rtol=0, atol=0)


def test_cache_is_not_an_input_of_a_compiled_forward() -> None:
    """torch.compile sees (q, k, v, metadata) -> out: the cache stays outside the graph, so it
    is neither functionalized nor copied, and the kernel's in-place write lands in it."""
    layout, q, k, v, k_hist, v_hist = mixed_step([4, 1], [4, 30], block=16, blocks=16, heads=4,
                                                 kv_heads=2, dim=16, dtype=torch.float32)
    k_cache, v_cache = to_kernel_layout(torch.zeros_like(k_hist), torch.zeros_like(v_hist))
    impl = PagedCpuAttention(None)
    cache_id = impl.bind_cache((k_cache, v_cache))
    meta = impl.metadata(layout, lambda array, token_major: torch.from_numpy(array))
    seen: list[list[torch.Tensor]] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        seen.append(list(example_inputs))
        return gm.forward

    def attend(q, k, v, meta):
        return impl.forward(q * 1.0, k, v, cache_id, meta, 0.25)[0]

    storage = k_cache.untyped_storage().data_ptr()
    compiled = torch.compile(attend, backend=recording_backend, fullgraph=True)
    out = compiled(q, k, v, meta)
    (inputs,) = seen
    assert all(t.untyped_storage().data_ptr() not in
               (storage, v_cache.untyped_storage().data_ptr()) for t in inputs)
    assert all(t.numel() < k_cache.numel() for t in inputs)
    assert k_cache.untyped_storage().data_ptr() == storage
    assert torch.count_nonzero(k_cache) > 0  # the step's keys were written in place
    eager, _ = impl.forward(q, k, v, cache_id, meta, 0.25)
    torch.testing.assert_close(out, eager)


def test_a_freed_cache_is_reported_not_read() -> None:
    layout, q, k, v, k_hist, v_hist = mixed_step([1], [3], block=16, blocks=4, heads=2,
                                                 kv_heads=2, dim=16, dtype=torch.float32)
    impl = PagedCpuAttention(None)
    k_cache, v_cache = to_kernel_layout(torch.zeros_like(k_hist), torch.zeros_like(v_hist))
    cache_id = impl.bind_cache((k_cache, v_cache))
    meta = impl.metadata(layout, lambda array, token_major: torch.from_numpy(array))
    impl.forward(q, k, v, cache_id, meta, 0.25)
    del k_cache, v_cache
    with pytest.raises(RuntimeError, match=f"KV cache {cache_id} was freed"):
        impl.forward(q, k, v, cache_id, meta, 0.25)
    with pytest.raises(RuntimeError, match="no KV cache has id -1"):
        impl.forward(q, k, v, -1, meta, 0.25)


_BUILD_AND_RUN = """
import torch
from meshserve.runner import kernels
kernels.load()
print(torch.ops.meshserve_cpu.paged_attention is not None)
"""


def test_a_fresh_machine_builds_the_kernel_once_without_ninja_on_path(tmp_path) -> None:
    """Two processes start at once on an empty kernel cache with a PATH that has the compiler but
    no ninja (CI runs ``.venv/bin/python`` without activating the venv): one builds, the other
    waits for it and loads the result."""
    import os
    import shutil
    import subprocess
    import sys

    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("c++", "g++", "gcc", "as", "ld"):
        found = shutil.which(tool)
        assert found, f"{tool} is needed to build the kernel"
        (tools / tool).symlink_to(found)
    env = dict(os.environ, PATH=str(tools), MESHSERVE_KERNEL_CACHE=str(tmp_path / "kernels"))
    runs = [subprocess.Popen([sys.executable, "-c", _BUILD_AND_RUN], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    results = [run.communicate(timeout=600) for run in runs]
    for run, (out, err) in zip(runs, results):
        assert run.returncode == 0, err[-2000:]
        assert out.strip() == "True"
    builds = sum(err.count("building the CPU attention kernel") for _, err in results)
    assert builds == 1
    assert not any("No CUDA runtime" in err for _, err in results), results
    assert not list((tmp_path / "kernels").glob("*/build-*")), "a scratch build folder was left"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cached", [16, 37, 249])
@pytest.mark.parametrize("window", [None, 150])
def test_a_prompt_over_its_cached_prefix_attends_as_it_did_whole(dtype, cached: int,
                                                                 window: int | None) -> None:
    """The same prompt, computed whole and then again with its first ``cached`` tokens found in
    the prefix cache, attends bit for bit alike: otherwise a near-tied greedy token can flip, and
    a request's streamed text differ from its twin's (the soak test's check). On paired blocks
    (tiles or pairs) the softmax folds a run of blocks at once, so where runs end is part of the
    arithmetic: the whole prompt's tiles of 48 rows and the rest's (down to 3 rows, the last token
    alone with 249 cached) must meet the same runs, also where a window makes their first blocks
    differ: token 245 sees blocks 6-15, and its tile's first block is 5 in the whole prompt, 6
    with 37 cached, so runs counted from the tile's first block would split its blocks at 13 and
    at 14."""
    length = 250
    whole, q, k, v, k_hist, v_hist = mixed_step([length], [length], block=16, blocks=20,
                                                heads=9, kv_heads=3, dim=64, dtype=dtype)
    k_cache, v_cache = to_kernel_layout(k_hist, v_hist)
    first = run_kernel(whole, q, k, v, k_cache, v_cache, 0.125, window)
    rest, *_ = mixed_step([length - cached], [length], block=16, blocks=20, heads=9,
                          kv_heads=3, dim=64, dtype=dtype)
    assert (rest.block_table == whole.block_table).all()  # the same blocks, as a cache hit
    pad = torch.zeros(3, *q.shape[1:], dtype=dtype)  # the layout's padding tokens
    again = run_kernel(rest, torch.cat([q[cached:length], pad]),
                       torch.cat([k[cached:length], pad[:, :3]]),
                       torch.cat([v[cached:length], pad[:, :3]]), k_cache, v_cache, 0.125, window)
    assert torch.equal(again[:length - cached], first[cached:length])


def test_bf16_takes_the_fastest_arithmetic_the_cpu_and_linux_offer() -> None:
    """The fast paths must not fall away unnoticed (a build flag, a refused permission): bf16
    caches are paired and attended on AMX tiles exactly where the CPU has AMX-BF16 and
    AVX512-BF16 and Linux grants the tile state, paired and attended with AVX-512 BF16 pair
    products where the CPU has AVX512-BF16 otherwise; fp32 never is, nor a head size the pairs do
    not divide. A suite run under ``MESHSERVE_CPU_ATTENTION`` expects its cap where it is slower."""
    import ctypes
    import os
    import platform

    expected = "floats"
    if platform.machine() == "x86_64" and "avx512_bf16" in cpu_flags():
        libc = ctypes.CDLL(None, use_errno=True)
        granted = libc.syscall(158, 0x1023, 18) == 0  # arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)
        expected = "tiles" if {"amx_bf16", "amx_tile"} <= cpu_flags() and granted else "pairs"
    cap = os.environ.get("MESHSERVE_CPU_ATTENTION", "auto")
    if cap != "auto":
        expected = min(expected, cap, key=("floats", "pairs", "tiles").index)
    assert ops.arithmetic(torch.bfloat16, 64, 16) == expected
    assert ops.paired_blocks(torch.bfloat16, 64, 16) == (expected != "floats")
    assert ops.arithmetic(torch.float32, 64, 16) == "floats"
    assert not ops.paired_blocks(torch.bfloat16, 80, 16)


_ARITHMETIC = """
import torch
from meshserve.runner.kernels import ops
print(ops.arithmetic(torch.bfloat16, 64, 16))
"""


def _with_cap(cap: str, *args: str):
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, MESHSERVE_CPU_ATTENTION=cap)
    return subprocess.run([sys.executable, *args], env=env, cwd=Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("cap", ["pairs", "floats"])
def test_every_arithmetic_the_cpu_offers_is_checked_here(cap: str) -> None:
    """``MESHSERVE_CPU_ATTENTION`` caps a process's arithmetic: under it a CPU with AMX attends
    bf16 with the pair products (or fp32) as a CPU without AMX would, and the bf16 tests above
    (the reference, and bit-equal rows over a cached prefix) pass again, so every arithmetic a
    CPU can run is checked on it, not only its fastest."""
    expected = "pairs" if cap == "pairs" and "avx512_bf16" in cpu_flags() else "floats"
    named = _with_cap(cap, "-c", _ARITHMETIC)
    assert named.returncode == 0, named.stderr[-2000:]
    assert named.stdout.strip() == expected
    again = _with_cap(cap, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                      "bfloat16_cache or (cached_prefix and bf16)")
    assert again.returncode == 0, again.stdout[-3000:]
    assert "24 passed" in again.stdout


def test_an_unknown_arithmetic_is_refused_by_name() -> None:
    refused = _with_cap("amx", "-c", _ARITHMETIC)
    assert refused.returncode != 0
    message = "MESHSERVE_CPU_ATTENTION must be auto, tiles, pairs or floats, got 'amx'"
    assert message in refused.stderr
