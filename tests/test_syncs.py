"""The host-sync budget: the counter (bench/opcount.py) on snippets whose syncs are known, the loop's
loss window, and ``commlab bench syncs`` run quickly on every method, whose counts are
deterministic, so its budget is a pass/fail check (docs/performance.md, "Host-sync budget")."""

from __future__ import annotations

import json
import math

import pytest
import torch

from commlab.bench.opcount import HostSyncCounter, TrafficCounter, sync_kind
from commlab.bench.syncs import budget, summarise
from commlab.loop.loop import add_loss
from commlab.registry import ALGORITHMS, BENCHMARKS


def count(fn) -> HostSyncCounter:
    counter = HostSyncCounter()
    with counter:
        fn()
    return counter


x = torch.randn(1000, generator=torch.Generator().manual_seed(0))

SNIPPETS = {  # name: (code, host syncs on CUDA)
    "arithmetic": (lambda: (x * 2 + 1).sum().sqrt(), 0),
    "item": (lambda: x.sum().item(), 1),
    "float": (lambda: float(x.max()), 1),
    "bool branch": (lambda: 1 if x.sum() > 0 else 0, 1),
    "int index": (lambda: list(range(10))[torch.tensor(3)], 1),
    "tolist": (lambda: x[:4].tolist(), 1),
    "nonzero": (lambda: torch.nonzero(x > 0), 1),
    "mask index": (lambda: x[x > 0], 1),
    "mask assign": (lambda: x.clone().__setitem__(x > 2, 0.0), 1),
    "long index": (lambda: x[torch.tensor([1, 5, 7])], 0),
    "unique": (lambda: torch.unique(x.round()), 1),
    "one-arg where": (lambda: torch.where(x > 0), 1),
    "three-arg where": (lambda: torch.where(x > 0, x, 0.0), 0),
    "topk and sort": (lambda: torch.sort(torch.topk(x.abs(), 10).indices), 0),
    "segment_reduce checked": (lambda: torch.segment_reduce(x[:4], "sum", lengths=torch.tensor([2, 2])), 1),
    "segment_reduce unsafe": (lambda: torch.segment_reduce(x[:4], "sum", lengths=torch.tensor([2, 2]), unsafe=True), 0),
    "cpu and numpy": (lambda: (x.cpu(), x.numpy()), 2),
    "to the run's device": (lambda: x.to(torch.device("cpu")), 0),
    "repeat_interleave": (lambda: torch.repeat_interleave(torch.tensor([1, 2])), 1),
    "nested": (lambda: [x[x > 0].tolist() for _ in range(3)], 6),
}


@pytest.mark.parametrize("name", sorted(SNIPPETS))
def test_the_counter_counts_what_waits_for_a_cuda_device(name):
    fn, syncs = SNIPPETS[name]
    assert count(fn).total == syncs


def test_the_counter_fails_a_sync_it_should_see_and_only_counts_while_entered():
    counter = HostSyncCounter()
    x.sum().item()  # outside: not counted
    with counter:
        value = float(x.sum())   # a budget of 0 fails here
        with counter.paused():
            x.sum().item()
    assert counter.total == 1 and value == pytest.approx(float(x.sum()))
    assert counter.by_kind == {"read": 1}
    [(site, n)] = counter.sites.items()
    assert site.startswith("test_syncs.py:") and site.endswith("__float__") and n == 1
    counter.reset()
    assert counter.total == 0 and not counter.sites
    assert sync_kind(torch.Tensor.__getitem__, (x, x > 0), {}) == "shape"
    assert sync_kind(torch.Tensor.__getitem__, (x, slice(0, 3)), {}) is None


def test_traffic_counter_counts_bytes_read_and_written():
    traffic, index = TrafficCounter(), torch.tensor([1, 2, 3])
    with traffic:
        x.sum()                          # reads 4n, writes 4
        x[index]                         # gathers 3 floats: 2 x 12 + 24 bytes of indices
    assert traffic.bytes == 4 * x.numel() + 4 + 2 * 12 + 24


def test_the_loop_sums_the_loss_on_the_device():
    window = torch.zeros((), dtype=torch.float64)
    counter = HostSyncCounter()
    with counter:
        for loss in (torch.tensor(0.5), torch.tensor(0.25)):
            add_loss(window, loss)
    assert counter.total == 0 and float(window) == 0.75
    add_loss(window, torch.tensor(float("nan")))
    assert math.isinf(float(window))   # a non-finite loss makes the window non-finite


def test_a_step_over_budget_is_reported_over_budget():
    runs = [{"name": "ssgd", "method": "ssgd", "params": {}}]
    records = [[[{"step": 1, "syncs": 1, "by_kind": {"read": 1}, "sites": {"x.py:1 item": 1},
                  "cuda_syncs": None, "kind": "reduction"}]]]
    [row] = summarise(runs, records)
    assert row["kind"] == "step" and row["within_budget"] is False and row["worst_sites"] == {"x.py:1 item": 1}


def run_bench(tmp_path, *argv: str) -> dict[tuple[str, str], dict]:
    out = tmp_path / "syncs.json"
    assert BENCHMARKS.get("syncs")(["--workers", "2", "--model", "mlp", "--batch-size", "4", "--options", "defaults",
                                     *argv], str(out)) == 0
    report = json.loads(out.read_text())
    rows = {(r["method"], r["kind"]): r for r in report["rows"]}
    over = [(key, r["max_syncs"], r["budget"], r["worst_sites"]) for key, r in rows.items()
            if r["within_budget"] is False]
    assert over == [] and report["all_within_budget"]
    return rows


def test_every_method_keeps_its_host_sync_budget(tmp_path):
    """Every registered method, 2 ranks, a small MLP, 5 steps after a 1-step warm-up, against the
    budget its class declares. On random batches the MLP's residuals grow fast, so every sparse
    Ok-Topk step corrects a threshold: its recompute budget is checked here, its typical steps below."""
    rows = run_bench(tmp_path, "--steps", "5")
    methods = ALGORITHMS.package_names()
    assert {method for method, _ in rows} == set(methods)
    for method in methods:
        limits = budget(method)
        assert limits, f"{method} declares no host-sync budget"
        for kind, most in limits.items():
            if (method, kind) == ("oktopk", "step"):
                continue
            row = rows[(method, kind)]   # measured, not skipped
            assert row["budget"] == most and row["max_syncs"] <= most
            # a budget above 0 is what the step needs: a sparse step reads at least one count,
            # a periodic reduction that probes V reads V
            assert most == 0 or row["max_syncs"] >= 1, (method, kind, row["max_syncs"])
    assert 4 <= rows[("oktopk", "recompute")]["max_syncs"] <= 16
    # methods without a budget ("not declared") would have rows without a verdict
    assert all(row["within_budget"] is not None for row in rows.values())


def test_a_method_without_a_budget_is_reported_as_measured_with_its_reason(monkeypatch):
    from commlab.algorithms.base import Algorithm, SyncBudget
    from commlab.bench.syncs import unbudgeted_reason

    class Undeclared(Algorithm):
        pass

    class Unbudgeted(Algorithm):
        host_sync_budget = SyncBudget.none("every step waits for the network anyway")

    known, real = {"undeclared": Undeclared, "unbudgeted": Unbudgeted}, ALGORITHMS.get
    monkeypatch.setattr(ALGORITHMS, "get", lambda name: known.get(name) or real(name))  # not registered for good
    for name in known:
        records = [[[{"step": 1, "syncs": 3, "by_kind": {"read": 3}, "sites": {}, "cuda_syncs": None,
                      "kind": "reduction"}]]]
        [row] = summarise([{"name": name, "method": name, "params": {}}], records)
        assert budget(name) is None and row["budget"] is None and row["within_budget"] is None
    assert unbudgeted_reason("undeclared") == "not declared"
    assert unbudgeted_reason("unbudgeted") == "every step waits for the network anyway"
    assert unbudgeted_reason("ssgd") is None and budget("ssgd") == {"step": 0}


def test_ok_topk_steps_without_a_recompute_keep_the_budget(tmp_path):
    """Ok-Topk whose thresholds are reused without corrections between exact ones (the release's
    control, exact every third step): both step kinds."""
    rows = run_bench(tmp_path, "--steps", "6", "--methods", "oktopk", "--param", "oktopk.threshold_control=release",
                     "--param", "oktopk.local_recompute_every=3", "--param", "oktopk.global_recompute_every=3")
    assert 1 <= rows[("oktopk", "step")]["max_syncs"] <= 8
    assert rows[("oktopk", "recompute")]["max_syncs"] <= 16
