"""The CPU's one-pass selection kernel (commlab.compress.native) against numpy's passes: every
compiled variant (AVX-512, AVX2, scalar) that this CPU runs, every thread split, and the awkward
values (NaN, infinities, signed zeros, subnormals, ties at the threshold)."""

import math
import shutil
import warnings

import numpy as np
import pytest
import torch

from commlab.compress import native
from commlab.compress.native import FLAGS, Buffers, Kernel, build
from commlab.compress.scan import (
    Scratch,
    at_least,
    compact,
    counts_at_least,
    select_above,
    select_at_least,
    select_pairs_at_least,
)

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

BASE = ("-O3", "-fopenmp", "-shared", "-fPIC", "-pthread")
VARIANTS = {  # name: (flags, the CPU flag it needs)
    "avx512": (FLAGS, "avx512f"),
    "avx2": (BASE + ("-mavx2", "-mbmi"), "avx2"),
    "scalar": (BASE + ("-mno-avx", "-mno-avx2"), None),
}


def reference(x: torch.Tensor, t: float) -> np.ndarray:
    """Positions with !(|x| < t) in float32, the definition numpy's passes compute."""
    a = np.abs(x.numpy())
    return np.flatnonzero(~(a < np.float32(t)))


def awkward(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if n >= 8:
        specials = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, -1e-40, 1.0])
        where = torch.randperm(n, generator=g)[:8]
        x[where] = specials
    return x


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    cpu = native._cpu()
    out = {}
    for name, (flags, needs) in VARIANTS.items():
        if needs is not None and needs not in cpu.split():
            continue
        out[name] = Kernel(build(flags, tmp_path_factory.mktemp(name)))
    return out


def test_variants_build_and_name_themselves(kernels):
    assert "scalar" in kernels
    for name, k in kernels.items():
        assert k.variant == name


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 63, 1000, 100_003, 2_100_017])
@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_same_positions_as_numpy(kernels, n, threads):
    x = awkward(n, seed=n + threads)
    finite = x[torch.isfinite(x)].abs()
    tie = float(finite.max()) if finite.numel() else 1.0  # an entry equal to t passes
    # 0.9 and 1.4 leave 64-entry words both sparse (peeled bit by bit) and dense (packed) in one x
    for t in (1e-45, 0.5, 0.9, 1.4, 2.5, tie, math.inf):
        want = reference(x, t)
        for name, k in kernels.items():
            got = k.select(x, t, threads=threads)
            assert got.dtype == torch.int64
            np.testing.assert_array_equal(got.numpy(), want, err_msg=f"{name}, t={t}, {threads} threads")
            idx, vals = k.select(x, t, threads=threads, values=True)
            assert torch.equal(idx, got)
            np.testing.assert_array_equal(vals.numpy(), x.numpy()[want])  # NaN equals NaN here


def test_reused_buffer_and_dense_selection(kernels):
    x = torch.randn(50_000)
    buf = Buffers()
    for k in kernels.values():
        assert torch.equal(k.select(x, 1e-45, buf), torch.arange(50_000))  # every entry passes
        np.testing.assert_array_equal(k.select(x, 1.0, buf).numpy(), reference(x, 1.0))
        assert k.select(x, math.inf, buf).numel() == 0
        idx, vals = k.select(x, 1.0, buf, values=True)
        assert torch.equal(vals, x[idx])


def test_selectors_give_numpys_result_with_and_without_the_kernel(monkeypatch):
    x = awkward(300_001, seed=3)
    scratch = Scratch()
    fast = [select_at_least(x, t, scratch) for t in (0.0, 0.7, 3.0)] + [select_above(x, 0.7, scratch)]
    fast_pairs = select_pairs_at_least(x, 0.7, scratch)
    assert native.kernel() is not None  # a compiler is here: the kernel ran
    monkeypatch.setenv("COMMLAB_NATIVE", "0")
    native.kernel.cache_clear()
    try:
        assert native.kernel() is None
        slow = [compact(at_least(x, t)) for t in (0.0, 0.7, 3.0)] + [select_above(x, 0.7)]
        slow_pairs = select_pairs_at_least(x, 0.7)
    finally:
        native.kernel.cache_clear()
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(fast_pairs[0], slow_pairs[0])
    assert torch.equal(fast_pairs[1].view(torch.int32), slow_pairs[1].view(torch.int32))  # bits: NaN too
    # float64 and non-contiguous tensors take numpy's passes
    assert not Kernel.supports(x.double()) and not Kernel.supports(x[::2])
    assert torch.equal(select_at_least(x[::2], 0.7), compact(at_least(x[::2].contiguous(), 0.7)))


def test_missing_compiler_warns_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("COMMLAB_NATIVE_CACHE", str(tmp_path))
    native.kernel.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert native.kernel() is None
        assert any("no-such-compiler" in str(w.message) for w in caught)
        x = torch.randn(1000)
        np.testing.assert_array_equal(select_at_least(x, 1.0).numpy(), reference(x, 1.0))
    finally:
        native.kernel.cache_clear()
    assert list(tmp_path.iterdir()) == []


def test_build_error_names_the_compiler_output(monkeypatch, tmp_path):
    with pytest.raises(RuntimeError, match="failed"):
        build(("-O3", "-shared", "--no-such-flag"), tmp_path)
    assert list(tmp_path.iterdir()) == []  # no partial library left behind


def test_cache_is_reused(tmp_path):
    first = build(FLAGS, tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build(FLAGS, tmp_path) == first and first.stat().st_mtime_ns == stamp


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_counts_match_numpy(kernels, threads):
    x = awkward(100_019, seed=threads)
    ts = [1e-45, 0.1, 1.0, 1.0, 2.0, 3.5, math.inf]
    a = np.abs(x.numpy())
    want = [int(np.count_nonzero(~(a < np.float32(t)))) for t in ts]
    for name, k in kernels.items():
        assert k.count(x, ts, threads=threads) == want, name
        assert k.count(x[:0], ts) == [0] * len(ts) and k.count(x, []) == []
    with pytest.raises(ValueError, match="at most"):
        next(iter(kernels.values())).count(x, [1.0] * 65)


def test_counts_at_least_same_with_and_without_the_kernel(monkeypatch):
    x = awkward(200_003, seed=9)
    few, many = [0.0, 0.5, 1.5, 2.5], [0.1 * j for j in range(30)]
    fast = (counts_at_least(x, few), counts_at_least(x, many))
    monkeypatch.setenv("COMMLAB_NATIVE", "0")
    native.kernel.cache_clear()
    try:
        assert (counts_at_least(x, few), counts_at_least(x, many)) == fast
    finally:
        native.kernel.cache_clear()
