"""RedSync's selectors against brute force: the threshold binary search keeps its band and
terminates on adversarial tensors; trimmed top-k returns exactly torch.topk's set."""

import pytest
import torch

from commlab.compress.binary_search import BinarySearchSelector, binary_search_select
from commlab.compress.trimmed_topk import trimmed_topk
from commlab.registry import SELECTORS


def assert_top_set(x: torch.Tensor, idx: torch.Tensor) -> None:
    """Distinct, int64, and no unselected entry is larger in magnitude than a selected one."""
    a = x.reshape(-1).abs()
    assert idx.dtype == torch.int64
    assert torch.unique(idx).numel() == idx.numel()
    chosen = torch.zeros_like(a, dtype=torch.bool)
    chosen[idx] = True
    if chosen.all() or not chosen.any():
        return
    assert a[chosen].min() >= a[~chosen].max()


def assert_band(idx: torch.Tensor, k: int) -> None:
    assert k / 2 < idx.numel() < 2 * k, (idx.numel(), k)


def adversarial(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    noise = torch.randn(n, generator=g)
    outlier = noise * 1e-3
    outlier[n // 3] = 1e30
    ties = torch.zeros(n)
    ties[: n // 10] = 2.0  # 10% tied at 2: counts jump 0 -> n/10 -> n
    ties[n // 10: n // 5] = 1.0
    staircase = torch.arange(n, dtype=torch.float32) // 50  # groups of 50 equal values
    return {
        "gaussian": noise,
        "all_equal": torch.full((n,), 3.0),
        "all_zero": torch.zeros(n),
        "one_huge_outlier": outlier,
        "outlier_in_zeros": torch.zeros(n).index_fill_(0, torch.tensor([n - 1]), 5.0),
        "negative_only": -noise.abs() - 1.0,
        "nearly_equal": 1.0 + 1e-7 * noise,
        "ties_at_boundary": ties,
        "staircase": staircase,
        "denormal_tail": noise * 1e-40,
        "int_tensor": (noise * 10).to(torch.int32),
    }


@pytest.mark.parametrize("case", list(adversarial(10).keys()))
@pytest.mark.parametrize("n,k", [(10_000, 10), (10_000, 1), (10_000, 2), (10_000, 2_500),
                                 (10_000, 6_000), (1_000, 999), (5, 5), (5, 9)])
def test_binary_search_band_and_termination(case, n, k):
    x = adversarial(n)[case]
    result = binary_search_select(x, k)
    if k >= n:
        assert torch.equal(result.indices, torch.arange(n))
        return
    assert_band(result.indices, k)
    assert_top_set(x, result.indices)
    assert result.probes <= 32 + 2  # max_iters plus the mean and zero probes: terminates
    if result.ratio is None:  # unreachable band: the fallback returns exactly k
        assert result.indices.numel() == k


def test_binary_search_band_on_random_tensors_equals_threshold_selection():
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        n = int(torch.randint(100, 50_000, (1,), generator=g))
        k = int(torch.randint(1, n, (1,), generator=g))
        scale = float(10.0 ** int(torch.randint(-12, 12, (1,), generator=g)))
        x = torch.randn(n, generator=g) * scale
        if trial % 3 == 0:
            x = x ** 3  # heavy tails
        result = binary_search_select(x, k)
        assert_band(result.indices, k)
        assert_top_set(x, result.indices)
        if result.ratio is not None:  # the set is exactly the entries above the found threshold
            above = torch.nonzero(x.abs() > result.threshold).view(-1)
            assert torch.equal(torch.sort(result.indices).values, above)


def test_binary_search_unreachable_band_returns_exactly_k_largest():
    x = torch.zeros(1000)
    x[:5] = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])  # 5 non-zero entries, k = 100: band needs > 50
    result = binary_search_select(x, 100)
    assert result.ratio is None and result.indices.numel() == 100
    assert set(range(5)) <= set(result.indices.tolist())  # every non-zero entry is in it


def test_binary_search_threshold_reuse_keeps_the_band():
    g = torch.Generator().manual_seed(3)
    select = BinarySearchSelector(reuse_every=4)
    x = torch.randn(200_000, generator=g)
    k = 200
    reused = []
    for _ in range(8):
        x = x + 0.01 * torch.randn(200_000, generator=g)  # slowly changing, as a residual does
        idx = select(x, k)
        assert_band(idx, k)
        assert_top_set(x, idx)
        reused.append(select.last.reused)
    assert reused[0] is False and any(reused)
    # a tensor from another distribution: the reused ratio misses the band, a search runs instead
    select.calls_since_search = 0
    y = torch.randn(200_000, generator=g) ** 5
    idx = select(y, k)
    assert_band(idx, k)
    state = select.state_dict()
    fresh = BinarySearchSelector(reuse_every=4)
    fresh.load_state_dict(state)
    assert fresh.ratio == select.ratio


@pytest.mark.parametrize("n,k", [(1_000, 1), (10_000, 10), (100_000, 100), (100_000, 7_000),
                                 (20_000, 15_000), (3_000, 2_999)])
@pytest.mark.parametrize("kind", ["gaussian", "negative", "outlier", "uniform"])
def test_trimmed_topk_equals_torch_topk(n, k, kind):
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(n, generator=g, dtype=torch.float64)  # float64: no ties in practice
    if kind == "negative":
        x = -x.abs()
    elif kind == "outlier":
        x[n // 2] = 1e12
    elif kind == "uniform":
        x = torch.rand(n, generator=g, dtype=torch.float64)
    assert torch.unique(x.abs()).numel() == n  # the comparison below needs a tie-free tensor
    idx = trimmed_topk(x, k)
    expected = torch.topk(x.abs(), k).indices
    assert idx.dtype == torch.int64 and idx.numel() == k
    assert set(idx.tolist()) == set(expected.tolist())


def test_trimmed_topk_degenerate_tensors_return_exactly_k():
    for x in (torch.zeros(100), torch.full((100,), -2.0), 1.0 + 1e-9 * torch.randn(100, dtype=torch.float64)):
        idx = trimmed_topk(x, 10)
        assert idx.numel() == 10
        assert_top_set(x, idx)
    assert torch.equal(trimmed_topk(torch.randn(4), 9), torch.arange(4))


def test_selectors_are_registered_and_validate_k():
    x = torch.randn(5_000)
    for name in ("binary_search", "trimmed_topk"):
        select = SELECTORS.get(name)()
        idx = select(x, 5)
        assert idx.dtype == torch.int64
        assert_top_set(x, idx)
        with pytest.raises(ValueError, match="k must be"):
            select(x, 0)
    with pytest.raises(ValueError, match="NaN"):
        binary_search_select(torch.tensor([1.0, float("nan"), 2.0]), 1)
    with pytest.raises(ValueError, match="reuse_every"):
        BinarySearchSelector(reuse_every=0)
