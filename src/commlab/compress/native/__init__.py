"""The CPU's one-pass threshold selection: a small C kernel, compiled on first use for the machine
that runs it (docs/performance.md, "Selection passes").

No library kernel compares a float32 tensor against a threshold and compacts the positions that
pass in one pass: with numpy (or torch) that is |x|, a comparison, and a compaction, about 15
bytes moved per element against 4 for one read. ``select.c`` does it in one read per element,
vectorised (AVX-512 or AVX2, whichever the compiler's ``-march=native`` finds; a scalar loop
otherwise), in chunks on torch's own OpenMP workers, and in one call from Python: the pass, a
guard's raised thresholds counted among the selected values and the raise applied
(:meth:`Kernel.select_guarded`, Ok-Topk's guard), and the result written into room sized from
the last count (no Python between the pass and the result, which would run with the caches
the pass evicted). Invariant: it gives exactly the numpy passes' result, the ascending
positions with !(|x| < t), so NaN passes and, with t >= the smallest positive float, zeros
never do.

The shared library is built with the system's C compiler (``$CC``, else ``cc``) into a cache
folder (``$COMMLAB_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/commlab/native``, else
``~/.cache/commlab/native``), named by a hash of the source, the flags, the compiler and the
CPU's model and flags, so that a cache shared by different machines keeps one build per kind of
CPU. Concurrent first uses each build to a private file and rename it into place. It links the
OpenMP runtime by its soname, ``libgomp.so.1``: the copy torch loaded is reused (with a torch
built against another OpenMP runtime it would load the system's beside it: correct, with two
thread pools). Without a compiler, or with ``COMMLAB_NATIVE=0``, :func:`kernel` is None (with one
warning naming why, unless disabled on purpose) and the selection falls back to numpy's passes:
slower, same result.

Example::

    >>> import torch
    >>> from commlab.compress.native import kernel
    >>> k = kernel()
    >>> x = torch.tensor([0.5, -2.0, 1.0, 0.0, float("nan")])
    >>> k.select(x, 1.0).tolist() if k else [1, 2, 4]
    [1, 2, 4]
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("select.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-pthread")
MAX_THREADS = 64
MAX_THRESHOLDS = 64  # select.c's bound on the thresholds of one count
STATE_LENGTH = MAX_THREADS * (1 + MAX_THRESHOLDS)  # select.c's per-chunk counts
# The chunks run on OpenMP workers, and they are torch's: the library is built with -fopenmp and
# loaded after torch, whose libgomp.so.1 the loader then reuses (one runtime, one pool). torch's
# workers keep spinning for a while after each of its parallel regions; threads of our own would
# compete with them for the cores, and lose to one thread.
PER_THREAD = 1 << 16  # elements each thread gets at least: below that a chunk costs more than it saves


def cache_dir() -> Path:
    if os.environ.get("COMMLAB_NATIVE_CACHE"):
        return Path(os.environ["COMMLAB_NATIVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "commlab" / "native"


def _cpu() -> str:
    """The CPU's model and feature flags (what ``-march=native`` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _compiler() -> str:
    cc = os.environ.get("CC") or "cc"
    found = shutil.which(cc)
    if found is None:
        raise RuntimeError(f"no C compiler: {cc!r} is not on PATH (set CC)")
    return found


def build(flags: tuple[str, ...] = FLAGS, cache: Path | None = None) -> Path:
    """The shared library of ``select.c`` built with ``flags`` (from the cache when there)."""
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(flags), version, _cpu()]).encode()).hexdigest()
    folder = cache or cache_dir()
    target = folder / f"select-{key[:20]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", partial, str(SOURCE)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} {' '.join(flags)} {SOURCE.name} failed:\n{done.stderr.strip()}")
        os.replace(partial, target)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


class Kernel:
    """The loaded library: :meth:`select` is the one-pass threshold selection of a float32 tensor,
    :meth:`count` the one-pass count of entries passing each of a few thresholds."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        lib.variant.restype = ctypes.c_char_p
        lib.select_f32.restype = ctypes.c_int64
        lib.select_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                   ctypes.c_double, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                   ctypes.POINTER(ctypes.c_int)]
        lib.count_f32.restype = None
        lib.count_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_void_p]
        lib.gather_chunks.restype = None
        lib.gather_chunks.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p,
                                      ctypes.c_void_p]
        self.lib = lib
        self.variant = lib.variant().decode()

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        """Whether :meth:`select` takes ``x``: a contiguous float32 CPU tensor with int32 positions."""
        return x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous() and x.numel() < 2**31

    def select(self, x: torch.Tensor, t: float, buffers: Buffers | None = None, threads: int | None = None,
               values: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Ascending int64 positions of flat float32 ``x`` with !(|x| < t) (t rounded to float32),
        with their values too when ``values``. ``buffers``: work space reused from call to call (a
        fresh one when None); ``threads``: how many chunks run at once (default torch's thread
        count, fewer when a chunk would get under ``PER_THREAD`` elements)."""
        idx, vals, _ = self._select(x, t, [], math.inf, buffers, threads, values)
        return (idx, vals) if values else idx

    def select_guarded(self, x: torch.Tensor, t: float, guards: list[float], limit: float,
                       buffers: Buffers | None = None, threads: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """:meth:`select` with values, guarded in the same call: when more than ``limit`` entries
        pass t, the pairs passing the first of ``guards`` (ascending thresholds above t, float32)
        that lets at most ``limit`` pass, or the last when none does. The guards are counted among
        the selected values as they are selected: no second pass over anything. Returns
        (positions, values, the index of the guard kept or None)."""
        if len(guards) > MAX_THRESHOLDS:
            raise ValueError(f"select_guarded takes at most {MAX_THRESHOLDS} guards, got {len(guards)}")
        return self._select(x, t, guards, limit, buffers, threads, True)

    def _select(self, x: torch.Tensor, t: float, guards: list[float], limit: float, buffers: Buffers | None,
                threads: int | None, values: bool):
        """One call of the C side: the pass, the guard, and the result gathered into room sized
        from the last selection (``Buffers.room``); a larger result is gathered by a second call
        into room of its size. The result is a view of its first ``total`` entries."""
        n, buffers = x.numel(), buffers or Buffers()
        positions, found, state = buffers.get(n, values)
        threads, m = _threads(n, threads), len(guards)
        room = buffers.room(n)
        out = torch.empty(room, dtype=torch.int64)  # host-side: the CPU kernel's result
        vals = torch.empty(room, dtype=torch.float32) if values else None  # host-side: CPU kernel only
        found_ptr, vals_ptr = (found.data_ptr(), vals.data_ptr()) if values else (None, None)
        ts = (ctypes.c_float * max(m, 1))(*guards)
        chosen = ctypes.c_int(-1)
        total = self.lib.select_f32(_address(x), n, t, positions.data_ptr(), found_ptr, threads, state.data_ptr(),
                                    ts, m, limit, out.data_ptr(), vals_ptr, room, ctypes.byref(chosen))
        j = chosen.value if chosen.value >= 0 else None
        buffers.selected = total
        if total > room:  # more than the room: gathered here, into room of its size
            out = torch.empty(total, dtype=torch.int64)  # host-side: the CPU kernel's result
            vals = torch.empty(total, dtype=torch.float32) if values else None  # host-side: CPU kernel only
            self.lib.gather_chunks(positions.data_ptr(), found_ptr, n, threads, state.data_ptr(), chosen.value,
                                   guards[j] if j is not None else 0.0, out.data_ptr(),
                                   vals.data_ptr() if values else None)
            return out, vals, j
        return out[:total], vals[:total] if values else None, j

    def count(self, x: torch.Tensor, thresholds: list[float], threads: int | None = None) -> list[int]:
        """For each threshold t (float32), how many entries of flat float32 ``x`` have !(|x| < t):
        one read of x for up to ``MAX_THRESHOLDS`` of them (each costs a comparison per element,
        so a caller with many thresholds narrows the entries first)."""
        if len(thresholds) > MAX_THRESHOLDS:
            raise ValueError(f"count takes at most {MAX_THRESHOLDS} thresholds, got {len(thresholds)}")
        n, m = x.numel(), len(thresholds)
        threads = _threads(n, threads)
        ts = (ctypes.c_float * max(m, 1))(*thresholds)
        out = (ctypes.c_int64 * max(m, 1))()
        self.lib.count_f32(_address(x), n, ts, m, threads, out)
        return list(out[:m])


def _threads(n: int, threads: int | None) -> int:
    """How many chunks a pass over ``n`` elements runs at once: ``threads``, by default torch's
    thread count but none with fewer than ``PER_THREAD`` elements; between 1 and MAX_THREADS."""
    if threads is None:
        threads = min(torch.get_num_threads(), n // PER_THREAD)
    return max(1, min(threads, MAX_THREADS))


def _address(x: torch.Tensor) -> int:
    """Where x's memory starts. The kernel is the host reading a tensor, which is what
    :class:`commlab.bench.opcount.HostSyncCounter` counts (on a GPU this read is a sync), so x
    passes through ``.numpy()`` to be counted; the address itself is ``data_ptr()``: numpy's
    ``.ctypes.data`` builds a ctypes object per call, costly with the caches cold, as between
    training steps."""
    x.numpy()
    return x.data_ptr()


class Buffers:
    """The kernel's work space: int32 positions and float32 values of a tensor's length and the
    C side's per-chunk counts, kept from call to call (a fresh multi-megabyte buffer per call
    costs page faults), and the last selection's count, which sizes the next result's room."""

    def __init__(self):
        self.positions: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.state = torch.zeros(STATE_LENGTH, dtype=torch.int64)  # host-side: the C side's per-chunk counts
        self.selected: int | None = None

    def get(self, n: int, values: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        if self.positions is None or self.positions.numel() != n:
            self.positions = torch.empty(n, dtype=torch.int32)  # host-side: CPU kernel only
            self.values = None
        if values and self.values is None:
            self.values = torch.empty(n, dtype=torch.float32)  # host-side: CPU kernel only
        return self.positions, self.values, self.state

    def room(self, n: int) -> int:
        """How many entries the next result makes room for: twice the last count (a selector's
        counts drift slowly), 1/16 of the tensor before the first; at most n."""
        return min(n, 1024 + (2 * self.selected if self.selected is not None else n // 16))


@functools.cache
def kernel() -> Kernel | None:
    """The kernel for this machine, built on first use; None when disabled (``COMMLAB_NATIVE=0``)
    or when it cannot be built (one warning says why)."""
    if os.environ.get("COMMLAB_NATIVE", "1") == "0":
        return None
    try:
        return Kernel(build())
    except (RuntimeError, OSError) as err:
        warnings.warn(f"commlab: the CPU selection kernel is not available ({err}); selections use "
                      f"numpy's passes (same result, slower). COMMLAB_NATIVE=0 silences this.",
                      RuntimeWarning, stacklevel=2)
        return None

