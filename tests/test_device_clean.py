"""Every tensor the core, the compressors, the methods and the loop create lives on the run's device
unless the code says it is deliberately host-side (docs/cluster.md, "GPUs").

Read from the source: a tensor factory (``torch.tensor``, ``zeros``, ``ones``, ``empty``, ``full``,
``arange``, ``rand*``, ``linspace``, ... and ``torch.Generator``) called without ``device=`` is a
CPU tensor, which on a GPU run either fails (``searchsorted`` with a CPU value over CUDA
boundaries) or costs a host-to-device copy per step. ``*_like`` and ``Tensor.new_*`` factories
inherit their device and are not flagged. A call is accepted without ``device=`` only when its
lines, or the comment lines right above it, carry a ``# host-side`` comment saying why.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "commlab"
PACKAGES = ("core", "compress", "algorithms", "loop")
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "range", "linspace", "logspace",
             "eye", "empty_strided", "rand", "randn", "randint", "randperm", "normal", "bernoulli", "tril_indices",
             "triu_indices", "Generator"}
MARK = "# host-side"


def unplaced_factories(source: str, name: str = "<source>") -> list[str]:
    """``name:line: code`` of every tensor factory in ``source`` with no ``device=`` and no mark."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and node.func.attr in FACTORIES):
            continue
        if any(k.arg == "device" for k in node.keywords) or any(k.arg is None for k in node.keywords):
            continue  # device= given (or **kwargs that may carry it)
        if node.func.attr == "Generator" and node.args:
            continue  # torch.Generator(device) positionally
        above = node.lineno - 2  # the comment lines right above the call count too
        while above >= 0 and lines[above].strip().startswith("#"):
            above -= 1
        if any(MARK in line for line in lines[above + 1:node.end_lineno]):
            continue
        found.append(f"{name}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def test_the_checker_flags_what_it_must():
    src = ("import torch\n"
           "a = torch.zeros(3)\n"                          # flagged
           "b = torch.zeros(3, device=x.device)\n"
           "c = torch.zeros_like(x)\n"
           "d = x.new_zeros(3)\n"
           "e = torch.tensor([1], dtype=torch.int64)  # host-side: read on the host\n"
           "# host-side: a constant\n"
           "f = torch.arange(4)\n"
           "g = torch.Generator()\n"                       # flagged
           "h = torch.rand(2, generator=g,\n"              # flagged (multi-line call)
           "               dtype=torch.float32)\n")
    assert [f.split(":")[1] for f in unplaced_factories(src)] == ["2", "9", "10"]


def test_core_compress_methods_and_loop_place_every_tensor():
    found = []
    for package in PACKAGES:
        for path in sorted((SRC / package).rglob("*.py")):
            found += unplaced_factories(path.read_text(), str(path.relative_to(SRC)))
    assert found == [], "tensor factories without device= (add device=, or say why with '# host-side: ...'):\n" \
        + "\n".join(found)
