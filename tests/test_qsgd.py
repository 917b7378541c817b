"""QSGD and fp16: the quantiser is unbiased within a statistical bound, packing is lossless, the
distributed methods average what every rank sent, and the recorded bytes are the message sizes."""

import pytest
import torch

from commlab.algorithms.fp16 import FP16
from commlab.algorithms.qsgd import QSGD, QSGD_STREAM
from commlab.algorithms.ssgd import SynchronousSGD
from commlab.compress.quantize import (
    QSGDQuantizer,
    default_levels,
    pack_codes,
    packed_size,
    unpack_codes,
)
from commlab.core.communicator import ring_allreduce_cost
from commlab.core.runtime import rank_generator
from commlab.models.small import TinyMLP
from commlab.testing import drive, run_distributed

SEED = 11


@pytest.mark.parametrize("bits", range(2, 9))
def test_pack_unpack_round_trip_and_sizes(bits):
    n = 1001  # not a multiple of the codes per byte
    codes = torch.randint(0, 2 * default_levels(bits) + 1, (n,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(bits))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_size(n, bits)
    assert packed.numel() == {2: 251, 3: 501, 4: 501}.get(bits, n)
    assert torch.equal(unpack_codes(packed, bits, n), codes)


@pytest.mark.parametrize("bits,norm,bucket", [(2, "l2", 64), (4, "l2", 128), (8, "l2", 4096),
                                              (4, "max", 100)])
def test_qsgd_is_unbiased(bits, norm, bucket):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(700, generator=g) * torch.linspace(0.01, 3, 700)
    x[100:164] = 0  # a zero stretch (a whole zero bucket when bucket=64)
    q = QSGDQuantizer(bits=bits, bucket_size=bucket, norm=norm)
    draws = 3000
    total = torch.zeros_like(x, dtype=torch.float64)
    gen = rank_generator(SEED, 0, QSGD_STREAM)
    for _ in range(draws):
        packed, norms = q.encode(x, gen)
        y = q.decode(packed, norms, x.numel())
        total += y.double()
    mean = total / draws
    # Each element is N/s times (floor + Bernoulli): the sd of the mean is at most
    # sqrt(bound / draws); 5 sd over 700 elements fails with probability below 1e-3.
    sd = (q.variance_bound(x).double() / draws).sqrt()
    assert ((mean - x.double()).abs() <= 5 * sd + 1e-7).all()
    # ... and the quantisation is not trivially exact: one draw differs from x.
    assert (y - x).abs().max() > 10 * (mean - x.double()).abs().max() or bits == 8
    assert torch.equal(y[100:164], torch.zeros(64))
    # Decoded values lie on the grid N * k / s with |k| <= s.
    k = q.quantize(x, gen)[0].to(torch.int64) - q.levels
    assert k.abs().max() <= q.levels


def test_quantizer_is_reproducible_for_a_seed_and_sized_exactly():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    q = QSGDQuantizer(bits=4, bucket_size=512)
    a = q.encode(x, rank_generator(SEED, 2, QSGD_STREAM))
    b = q.encode(x, rank_generator(SEED, 2, QSGD_STREAM))
    c = q.encode(x, rank_generator(SEED, 3, QSGD_STREAM))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    assert q.message_bytes(1000) == a[0].numel() + 4 * a[1].numel() == 500 + 8
    assert QSGDQuantizer(bits=8, bucket_size=512).message_bytes(1000) == 1000 + 8
    with pytest.raises(ValueError, match="levels"):
        QSGDQuantizer(bits=4, levels=8)


# ---- the distributed methods ---------------------------------------------------------------------
def _one_step(cls, params, rank):
    """One step of the method on this rank's gradients; (the method, its raw flat gradient), with
    only the step's traffic counted."""
    torch.manual_seed(0)
    model = TinyMLP(hidden=8)
    g = rank_generator(5, rank, 9)
    grads = [torch.randn(p.shape, generator=g) * (rank + 1) for p in model.parameters()]
    driven = drive(cls, params, model=model, train={"lr": 0.1, "optimizer": "sgd"}, seed=SEED, steps_per_epoch=10,
                   total_steps=100, grads=lambda step: grads)
    stats = driven.comm.stats
    stats.counters = dict.fromkeys(stats.counters, 0)  # count the step's traffic only
    stats.drain()
    return driven.run(1).algo, torch.cat([t.reshape(-1) for t in grads])


def _grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()


def _methods(rank, world):
    out = {}
    for bits in (4, 8):
        algo, raw = _one_step(QSGD, {"bits": bits, "bucket_size": 100}, rank)
        # What this rank sent, decoded: the same draws from a fresh generator of the same stream.
        q = algo.quantizer
        mine = q.decode(*q.encode(raw, rank_generator(SEED, rank, QSGD_STREAM)), raw.numel())
        out[f"qsgd{bits}"] = (_grads(algo.model), mine, algo.comm.stats.drain(),
                              algo.comm.stats.totals(), q.message_bytes(raw.numel()), raw.numel())
    for cls in (FP16, SynchronousSGD):
        algo, raw = _one_step(cls, {}, rank)
        out[cls.__name__] = (_grads(algo.model), raw, algo.comm.stats.totals())
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_methods, 4)


@pytest.mark.parametrize("bits", [4, 8])
def test_qsgd_averages_what_every_rank_sent_and_counts_exact_bytes(ranks, bits):
    world = len(ranks)
    results = [r[f"qsgd{bits}"] for r in ranks]
    reference = torch.stack([r[1] for r in results]).mean(0)  # dense mean of the sent messages
    raw_mean = torch.stack([r["SynchronousSGD"][1] for r in ranks]).mean(0)
    for grad, _, calls, totals, message_bytes, n in results:
        torch.testing.assert_close(grad, reference, rtol=0, atol=1e-6)
        assert torch.equal(grad, results[0][0])  # every replica applies the same gradient
        codes_call, norms_call = calls
        assert codes_call.op == norms_call.op == "all_gather"
        assert codes_call.bytes_sent == (world - 1) * packed_size(n, bits)  # uint8 codes
        assert norms_call.bytes_sent == (world - 1) * 4 * -(-n // 100)  # one float32 per bucket
        assert totals["bytes_sent"] == totals["bytes_recv"] == (world - 1) * message_bytes
        assert totals["reductions_global"] == 1
    # The quantised mean is an estimate of the dense mean, not far from it at 8 bits.
    err = (results[0][0] - raw_mean).norm() / raw_mean.norm()
    assert err < (0.05 if bits == 8 else 0.6)


def test_fp16_allreduce_halves_the_bytes_of_dense(ranks):
    dense_mean = torch.stack([r["FP16"][1] for r in ranks]).mean(0)
    for rank, r in enumerate(ranks):
        grad, _, totals = r["FP16"]
        ssgd_grad, _, ssgd_totals = r["SynchronousSGD"]
        torch.testing.assert_close(ssgd_grad, dense_mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, dense_mean, rtol=2e-3, atol=2e-3)  # fp16 rounding
        assert not torch.equal(grad, ssgd_grad)
        n = grad.numel()
        assert totals["bytes_sent"] == 2 * ring_allreduce_cost(n, len(ranks), rank)[0]
        assert 2 * totals["bytes_sent"] == ssgd_totals["bytes_sent"]
        assert totals["reductions_global"] == 1
