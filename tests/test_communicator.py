"""The Communicator: results equal torch's collectives and byte counts equal the costs of gloo's
algorithms (commlab.core.costs; checked against the wire in tests/test_netem.py)."""

import json
from pathlib import Path

import pytest
import torch

from commlab.core import Communicator, communicator
from commlab.core.communicator import ring_allreduce_cost
from commlab.core.costs import broadcast_sends, gloo_ring_chunks, ring_allreduce_messages
from commlab.testing import run_distributed

# gloo's ring allreduce of 10 floats: 2P segments of ceil(10 / 2P) elements, S/P segments a chunk.
# Per rank (sent, received, messages sent); on 4 ranks the last two chunks hold 2 and 0 elements.
ALLREDUCE_10 = {2: [(10, 10, 4), (10, 10, 4)],
                4: [(16, 12, 8), (12, 14, 6), (14, 18, 7), (18, 16, 9)]}


def _collectives(rank, world, n):
    comm = Communicator()
    out = {}
    x = torch.arange(n, dtype=torch.float32) * (rank + 1)
    comm.all_reduce(x)
    out["all_reduce"] = (x, comm.stats.drain()[-1])
    y = torch.full((n,), float(rank))
    comm.all_reduce(y, op="avg")
    out["avg"] = (y, comm.stats.drain()[-1])
    b = torch.full((n,), float(rank), dtype=torch.float64)
    comm.broadcast(b, src=1 % world)
    out["broadcast"] = (b, comm.stats.drain()[-1])
    g = comm.all_gather(torch.full((3,), rank, dtype=torch.int64))
    out["all_gather"] = (g, comm.stats.drain()[-1])
    direct = communicator.DIRECT_GATHER_BYTES
    communicator.DIRECT_GATHER_BYTES = 0  # the ring, as for a large block (or under NCCL)
    try:
        ring = comm.all_gather(torch.full((3,), rank, dtype=torch.int64))
    finally:
        communicator.DIRECT_GATHER_BYTES = direct
    out["ring_all_gather"] = (ring, comm.stats.drain()[-1])
    rs = comm.reduce_scatter(torch.ones(world * 2, dtype=torch.float32) * rank)
    out["reduce_scatter"] = (rs, comm.stats.drain()[-1])
    with comm.reduction():
        comm.all_reduce(torch.ones(4))
        comm.all_reduce(torch.ones(4))
    out["counters"] = comm.stats.totals()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_dense_collectives_values_and_standard_costs(world):
    n = 10  # not divisible by 4: exercises uneven ring chunks
    results = run_distributed(_collectives, world, args=(n,))
    total = sum(r + 1 for r in range(world))
    for rank, out in enumerate(results):
        x, rec = out["all_reduce"]
        assert torch.equal(x, torch.arange(n, dtype=torch.float32) * total)
        assert (rec.elements_sent, rec.elements_recv, rec.messages) == ALLREDUCE_10[world][rank]
        assert rec.bytes_sent == 4 * rec.elements_sent and rec.scope == "global"
        y, _ = out["avg"]
        assert torch.allclose(y, torch.full((n,), (world - 1) / 2))
        b, rec = out["broadcast"]
        src = 1 % world
        assert torch.equal(b, torch.full((n,), float(src), dtype=torch.float64))
        assert rec.elements_recv == (0 if rank == src else n)
        # binomial tree from rank 1: on 4 ranks rank 1 sends to ranks 2 and 3, rank 2 to rank 0
        copies = {2: [0, 1], 4: [0, 2, 1, 0]}[world][rank]
        assert (rec.elements_sent, rec.messages) == (copies * n, copies)
        assert rec.bytes_recv == 8 * rec.elements_recv
        g, rec = out["all_gather"]
        assert torch.equal(g, torch.arange(world).unsqueeze(1).expand(world, 3))
        assert rec.elements_sent == rec.elements_recv == 3 * (world - 1)
        assert rec.messages == world - 1  # gloo, a small CPU block: one direct exchange
        ring, ring_rec = out["ring_all_gather"]
        assert torch.equal(ring, g)
        assert (ring_rec.elements_sent, ring_rec.elements_recv) == (rec.elements_sent, rec.elements_recv)
        assert ring_rec.messages == 2 * (world - 1)  # the ring, in halves
        rs, rec = out["reduce_scatter"]
        assert torch.equal(rs, torch.full((2,), float(sum(range(world)))))
        assert rec.elements_sent == rec.elements_recv == 2 * (world - 1)
        assert rec.messages == world - 1  # one direct exchange of the blocks, not gloo's allreduce
        counters = out["counters"]
        assert counters["reductions_global"] == 1
        assert counters["collectives_global"] == 8
    # Conservation: what all ranks send, all ranks receive.
    for key in ("all_reduce", "broadcast", "all_gather", "reduce_scatter"):
        assert sum(o[key][1].elements_sent for o in results) == sum(o[key][1].elements_recv for o in results)


def test_ring_allreduce_cost_divisible_equals_textbook():
    for p in (2, 3, 4, 8):
        n = 24 * p
        for i in range(p):
            assert ring_allreduce_cost(n, p, i) == (2 * n * (p - 1) // p, 2 * n * (p - 1) // p)
    assert ring_allreduce_cost(100, 1, 0) == (0, 0)


def test_costs_follow_gloos_segments_and_tree():
    # 4-element allreduce on 4 ranks (the loop's control scalars, float64): chunks 2, 2, 0, 0 so
    # rank 3 sends the whole tensor twice where an even split would have it send 6 of 8 elements.
    assert gloo_ring_chunks(4, 4, 8) == [2, 2, 0, 0]
    assert [ring_allreduce_cost(4, 4, i, 8) for i in range(4)] == [(6, 4), (4, 6), (6, 8), (8, 6)]
    # above 2P MiB the segments are at most 1 MiB: 12 MiB + 20 B -> 16 segments of 196609 floats
    big = 3 * 2**20 + 5
    assert gloo_ring_chunks(big, 4) == [786436, 786436, 786436, 786425]
    assert [ring_allreduce_messages(big, 4, i) for i in range(4)] == [24] * 4
    assert [ring_allreduce_messages(big, 4, i, element_size=8) for i in range(4)] == [42] * 4  # 28 segments
    assert ring_allreduce_cost(big, 4, 3) == (2 * big - 786425 - 786436, 2 * big - 786425 - 786436)
    # whatever the chunks, all ranks together send 2(P-1)n
    for n, p in [(1, 4), (7, 3), (10, 4), (1001, 8), (big, 5)]:
        assert sum(ring_allreduce_cost(n, p, i)[0] for i in range(p)) == 2 * (p - 1) * n
    assert [broadcast_sends(5, i, 0) for i in range(5)] == [3, 1, 0, 0, 0]
    assert [broadcast_sends(4, i, 2) for i in range(4)] == [0, 0, 2, 1]
    assert broadcast_sends(1, 0, 0) == 0 and ring_allreduce_messages(10, 1, 0) == 0


def _variable(rank, world):
    comm = Communicator()
    # Rank r sends (r + j) % 3 rows of width 2 to rank j (zeros included); each row names its route.
    counts = [(rank + j) % 3 for j in range(world)]
    rows = [torch.tensor([rank * 100 + j, i], dtype=torch.int64) for j in range(world) for i in range(counts[j])]
    payload = torch.stack(rows) if rows else torch.empty((0, 2), dtype=torch.int64)
    received, recv_counts = comm.all_to_all_single(payload, counts)
    calls = comm.stats.drain()
    # allgatherv with uneven and empty contributions; int indices above 2^24 survive.
    mine = torch.arange(rank, dtype=torch.int64) + 2**24 + 1 + rank * 10
    gathered = comm.all_gatherv(mine)
    gcalls = comm.stats.drain()
    # The padded gather costs what an all_gather of the largest block costs.
    comm.all_gather(torch.zeros(world - 1, dtype=torch.int64))
    plain = comm.stats.drain()[0]
    # Rows of two float64 columns: padding rows and widths count element by element.
    rows = torch.full((rank % 2, 2), float(rank), dtype=torch.float64)
    wide = comm.all_gatherv(rows)
    wcalls = comm.stats.drain()
    # Every rank empty: the counts alone, no data collective.
    empty = comm.all_gatherv(torch.empty(0, dtype=torch.float32))
    ecalls = comm.stats.drain()
    return received, recv_counts, calls, gathered, gcalls, plain, wide, wcalls, empty, ecalls


@pytest.mark.parametrize("world", [2, 3, 4])
def test_uneven_all_to_all_and_allgatherv_are_exact(world):
    results = run_distributed(_variable, world)
    for rank, (received, recv_counts, calls, gathered, gcalls, plain, wide, wcalls, empty, ecalls) in \
            enumerate(results):
        expected_counts = [(src + rank) % 3 for src in range(world)]
        assert recv_counts == expected_counts
        expected = [[src * 100 + rank, i] for src in range(world) for i in range(expected_counts[src])]
        assert received.tolist() == expected
        counts_call, data_call = calls
        assert counts_call.op == "all_to_all_counts" and counts_call.elements_sent == world - 1
        sent_rows = sum((rank + j) % 3 for j in range(world)) - (rank + rank) % 3
        assert data_call.elements_sent == 2 * sent_rows
        assert data_call.elements_recv == 2 * (sum(expected_counts) - expected_counts[rank])
        assert [g.tolist() for g in gathered] == [
            (torch.arange(r) + 2**24 + 1 + r * 10).tolist() for r in range(world)]
        assert gathered[0].numel() == 0 and gathered[0].dtype == torch.int64
        # One all_gather of the counts, one of the blocks padded to the largest (world - 1 rows):
        # every rank sends and receives (P - 1) padded blocks, padding included.
        size_call, gather_call = gcalls
        assert size_call.op == "all_gatherv_counts" and gather_call.op == "all_gatherv"
        assert size_call.elements_sent == size_call.elements_recv == world - 1
        assert size_call.messages == gather_call.messages == world - 1  # small blocks on gloo: direct
        assert gather_call.elements_sent == gather_call.elements_recv == (world - 1) * (world - 1)
        assert gather_call.bytes_sent == gather_call.bytes_recv == 8 * (world - 1) ** 2
        assert (gather_call.elements_sent, gather_call.bytes_sent) == (plain.elements_sent, plain.bytes_sent)
        assert [w.tolist() for w in wide] == [[[float(r)] * 2] * (r % 2) for r in range(world)]
        assert all(w.shape[1:] == (2,) and w.dtype == torch.float64 for w in wide)
        _, wide_call = wcalls
        assert wide_call.elements_sent == wide_call.elements_recv == (world - 1) * 2  # one padded row of 2
        assert wide_call.bytes_sent == 8 * wide_call.elements_sent
        assert [e.numel() for e in empty] == [0] * world and len(ecalls) == 1
        assert ecalls[0].op == "all_gatherv_counts"


def _p2p(rank, world):
    comm = Communicator()
    t = torch.full((5,), float(rank))
    if rank == 0:
        comm.send(t, dst=1)
    elif rank == 1:
        comm.recv(t, src=0)
    return t, comm.stats.totals()


def test_send_recv_counts():
    (t0, c0), (t1, c1) = run_distributed(_p2p, 2)
    assert torch.equal(t1, torch.zeros(5))
    assert c0["bytes_sent"] == 20 and c0["bytes_recv"] == 0 and c0["messages_sent"] == 1
    assert c1["bytes_recv"] == 20 and c1["bytes_sent"] == 0 and c1["messages_sent"] == 0


def _subgroup(rank, world):
    import torch.distributed as dist

    from commlab.core.runtime import node_groups

    comm = Communicator()
    group, index = node_groups(2, world)
    local = comm.subgroup(group)
    x = torch.tensor([float(rank)])
    with local.reduction():
        local.all_reduce(x, op="avg")
    assert dist.get_world_size(group) == 2
    return x.item(), index, comm.stats.totals()


def test_subgroup_is_local_scope():
    results = run_distributed(_subgroup, 4)
    for rank, (value, index, totals) in enumerate(results):
        assert index == rank // 2
        assert value == pytest.approx((2 * index + 2 * index + 1) / 2)
        assert totals["reductions_local"] == 1 and totals["reductions_global"] == 0
        assert totals["collectives_local"] == 1 and totals["collectives_global"] == 0


def test_call_records_are_bounded_but_counters_count_every_call():
    from commlab.core.stats import MAX_CALLS, CommStats

    stats = CommStats()
    for i in range(MAX_CALLS + 10):
        stats.record("all_reduce", "global", i, i, 4, 0.0)
    assert stats.counters["collectives_global"] == MAX_CALLS + 10
    assert stats.counters["elements_sent"] == sum(range(MAX_CALLS + 10))
    calls = stats.drain()
    assert len(calls) == MAX_CALLS and calls[-1].elements_sent == MAX_CALLS + 9 and calls[0].elements_sent == 10
    assert stats.drain() == []


def test_stats_keep_bytes_and_messages_per_operation_across_a_checkpoint():
    from commlab.core.stats import CommStats

    stats = CommStats(wire=None)
    stats.record("all_reduce", "global", 10, 10, 4, 0.0, messages=3)
    stats.record("all_reduce", "global", 5, 5, 4, 0.0, messages=2)
    stats.record("all_to_all", "local", 2, 1, 8, 0.0, messages=1)
    assert stats.by_op == {"all_reduce": {"bytes_sent": 60, "messages_sent": 5},
                           "all_to_all": {"bytes_sent": 16, "messages_sent": 1}}
    assert stats.totals()["messages_sent"] == 6 and "wire_tx_bytes" not in stats.totals()
    resumed = CommStats(wire=None)
    resumed.load_state_dict(json.loads(json.dumps(stats.state_dict())))
    assert resumed.by_op == stats.by_op and resumed.counters == stats.counters
    resumed.load_state_dict({"counters": stats.counters})  # a checkpoint from before by_op
    assert resumed.by_op == {}


def _fake_interface(path, name, tx, rx):
    """A /proc/net/dev with ``lo`` and ``name``: 8 receive fields, then 8 transmit fields."""
    head = ("Inter-|   Receive                                                |  Transmit\n"
            " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls "
            "carrier compressed\n")
    lo = "    lo:  77 1 0 0 0 0 0 0  77 1 0 0 0 0 0 0\n"
    path.write_text(head + lo + f"  {name}: {rx} {rx // 100} 0 0 0 0 0 0 {tx} {tx // 100} 0 0 0 0 0 0\n")


def test_interface_counters_come_from_this_namespaces_proc_net_dev():
    from commlab.core.stats import read_interface

    before = {k: int(Path(f"/sys/class/net/lo/statistics/{k}").read_text()) for k in ("tx_bytes", "rx_packets")}
    now = read_interface("lo")
    after = {k: int(Path(f"/sys/class/net/lo/statistics/{k}").read_text()) for k in ("tx_bytes", "rx_packets")}
    assert all(before[k] <= now[k] <= after[k] for k in before)
    with pytest.raises(ValueError, match="no such network interface"):
        read_interface("nosuch0")


def test_wire_meter_adds_the_interface_counters_and_logs_every_rank(tmp_path, monkeypatch):
    from commlab.core.stats import CommStats, WireMeter

    dev = tmp_path / "dev"
    _fake_interface(dev, "eth0", 1000, 2000)
    meter = WireMeter("eth0", log_dir=str(tmp_path / "wire"), rank=2, proc_net_dev=str(dev))
    stats = CommStats(wire=meter)
    stats.record("all_gather", "global", 3, 3, 4, 0.0, messages=2)
    first = stats.totals()
    assert (first["wire_tx_bytes"], first["wire_rx_bytes"], first["wire_tx_packets"]) == (1000, 2000, 10)
    _fake_interface(dev, "eth0", 5000, 2500)
    assert stats.totals()["wire_tx_bytes"] == 5000
    lines = [json.loads(x) for x in (tmp_path / "wire" / "rank2.jsonl").read_text().splitlines()]
    assert [x["point"] for x in lines] == [0, 1] and lines[1]["wire_rx_packets"] == 25
    assert lines[0]["bytes_sent"] == 12 and lines[0]["by_op"] == {"all_gather": {"bytes_sent": 12, "messages_sent": 2}}
    # the launcher names the interface; a wrong name is a clear error
    monkeypatch.setenv("COMMLAB_WIRE_INTERFACE", "eth7")
    monkeypatch.setenv("RANK", "3")
    env_meter = WireMeter.from_env()
    assert env_meter.interface == "eth7" and env_meter.rank == 3 and env_meter.log_dir is None
    with pytest.raises(ValueError, match="COMMLAB_WIRE_INTERFACE=eth7"):
        CommStats(wire=env_meter).totals()
    monkeypatch.delenv("COMMLAB_WIRE_INTERFACE")
    assert CommStats().wire is None
