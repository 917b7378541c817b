"""The Triton selection kernels (commlab.compress.triton_select) run by Triton's interpreter on
the CPU against torch's passes: positions, values and counts bit for bit, over block edges, NaN,
infinities, signed zeros, subnormals and ties, with the room made in advance too small, right and
too large, a count known in advance, and a guard's raised thresholds counted by the selection.
Skipped where Triton is not installed (the GPU suite runs them compiled on CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from commlab.compress import floatbits, scan, triton_select as ts

    def bits(t):
        return floatbits.pattern(t, torch.float32)

    g = torch.Generator().manual_seed(0)
    checked = 0
    for n in (0, 1, 31, 32, 33, 255, 256, 257, 2000):
        x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
        special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.5, -1.5, 1e-45, 1.5])
        x[: min(n, 9)] = special[: min(n, 9)]
        for t in (0.0, 1e-45, 0.5, 1.5, 3.0, float("inf")):
            with scan.portable_passes():
                want_idx, want_vals = scan.select_pairs_at_least(x, t)
                raises = [t * 1.03 ** j for j in range(1, 6)]
                want_counts = scan.counts_at_least(want_vals, raises)
            for room in (None, 0, want_idx.numel(), 3 * want_idx.numel() + 7):
                for values in (True, False):
                    idx, vals = ts.select(x, bits(t), values=values, capacity=room, block=256)
                    assert torch.equal(idx, want_idx), (n, t, room)
                    if values:
                        assert torch.equal(vals.view(torch.int32), want_vals.view(torch.int32)), (n, t, room)
                    else:
                        assert vals is None
                    checked += 1
                idx, vals, counts = ts.select_counting(x, bits(t), [bits(u) for u in raises], capacity=room, block=256)
                assert torch.equal(idx, want_idx) and torch.equal(vals.view(torch.int32), want_vals.view(torch.int32))
                assert counts == want_counts, (n, t, room, counts, want_counts)
                checked += 1
            idx, vals = ts.select(x, bits(t), total=want_idx.numel(), block=256)  # a count known: no read
            assert torch.equal(idx, want_idx) and torch.equal(vals.view(torch.int32), want_vals.view(torch.int32))
            checked += 1
        ts_list = sorted({floatbits.compared(t, torch.float32)
                          for t in (0.0, 0.3, 0.5, 1.5, 2.0, 3.0, 1e30, float("inf"))})
        with scan.portable_passes():
            want = scan.counts_at_least(x, ts_list)
        assert ts.count(x, [bits(t) for t in ts_list], block=512) == want, (n, want)
    print("checked", checked)
""")


def test_the_triton_kernels_select_and_count_as_torch_passes_do_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["checked", str(9 * 6 * (4 * 3 + 1))]
