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
    # 1.86 keeps about 1 in 16, where the AVX-512 kernel switches between packing the values
    # and loading them (blocks of 1024 entries on either side of its limit in one x)
    for t in (1e-45, 0.5, 0.9, 1.4, 1.86, 2.5, tie, math.inf):
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


def guard_rule(total: int, counts: list[int], limit: float) -> int | None:
    """The guard, written out: over the limit, the first raise within it, else the last."""
    if total <= limit:
        return None
    return next((j for j, c in enumerate(counts[:-1]) if c <= limit), len(counts) - 1)


@pytest.mark.parametrize("n", [0, 17, 100_003, 2_100_017])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("t", [1.0, 2.5])  # values packed, values loaded (AVX-512)
def test_guarded_selection_keeps_what_numpy_would(kernels, n, threads, t):
    x = awkward(n, seed=7 * n + threads)
    guards = [t * 1.03**j for j in range(1, 6)] + [math.inf]
    a = np.abs(x.numpy())
    total = reference(x, t).size
    counts = [int(np.count_nonzero(~(a < np.float32(u)))) for u in guards]
    # no guard needed; each raise the first within; none within (the last, inf: nothing kept)
    for limit in [math.inf, total, *counts[:5], -1]:
        want = guard_rule(total, counts, limit)
        kept = reference(x, t if want is None else guards[want])
        for name, k in kernels.items():
            for buf in (None, Buffers()):  # room before a first count, and from the last count
                for _ in range(2):
                    idx, vals, j = k.select_guarded(x, t, guards, limit, buf, threads)
                    assert j == want, (name, limit)
                    np.testing.assert_array_equal(idx.numpy(), kept, err_msg=f"{name}, limit={limit}")
                    np.testing.assert_array_equal(vals.numpy(), x.numpy()[kept])
    with pytest.raises(ValueError, match="at most"):
        next(iter(kernels.values())).select_guarded(x, t, [2.0] * 65, 10)


def test_a_result_larger_than_the_room_is_gathered_whole(kernels):
    x = awkward(300_001, seed=5)
    for k in kernels.values():
        buf = Buffers()
        assert k.select(x, 3.0, buf).numel() == reference(x, 3.0).size  # a small count: little room next
        assert buf.room(x.numel()) < reference(x, 0.5).size
        idx, vals = k.select(x, 0.5, buf, values=True)  # far more than the room
        np.testing.assert_array_equal(idx.numpy(), reference(x, 0.5))
        np.testing.assert_array_equal(vals.numpy(), x.numpy()[reference(x, 0.5)])
        limit = reference(x, 0.5 * 1.03).size  # a guard kept past the room
        idx, vals, j = k.select_guarded(x, 0.1, [0.5, 0.5 * 1.03, 3.0], limit, Buffers())
        assert j == 1
        np.testing.assert_array_equal(idx.numpy(), reference(x, 0.5 * 1.03))
        np.testing.assert_array_equal(vals.numpy(), x.numpy()[reference(x, 0.5 * 1.03)])


def test_guarded_selection_same_with_and_without_the_kernel(monkeypatch):
    from commlab.compress.scan import select_pairs_guarded

    x = awkward(300_007, seed=11)
    raises = [1.5 * 1.03**j for j in range(1, 6)]
    count = [int(np.count_nonzero(~(np.abs(x.numpy()) < np.float32(u)))) for u in raises]
    # under the limit; over it, the second raise the first within; none within (the last); no raises
    cases = [(raises, 10**9), (raises, (count[0] + count[1]) // 2), (raises, 10), ([], 10)]

    def run():
        scratch = Scratch()
        return [select_pairs_guarded(x, 1.5, r, limit, scratch) for r, limit in cases]

    fast = run()
    assert [j for _, _, j in fast] == [None, 1, 4, None]
    monkeypatch.setenv("COMMLAB_NATIVE", "0")
    native.kernel.cache_clear()
    try:
        slow = run()
    finally:
        native.kernel.cache_clear()
    for (i1, v1, j1), (i2, v2, j2), (r, limit) in zip(fast, slow, cases, strict=True):
        assert j1 == j2 and torch.equal(i1, i2) and torch.equal(v1.view(torch.int32), v2.view(torch.int32))
        kept = r[j1] if j1 is not None else 1.5
        np.testing.assert_array_equal(i1.numpy(), reference(x, kept))
        assert j1 is None or i1.numel() <= limit or j1 == len(r) - 1
