"""The package's layering holds (docs/architecture.md): read from the source, every import counted,
also those inside functions.

* no import cycle among commlab's modules;
* ``core`` imports nothing of commlab above it;
* no module imports a package or top-level module of a layer above its own (:data:`LAYERS`: the
  loop above tracking and provenance, launching above the loop, ...);
* ``compress`` and ``algorithms`` never import the loop, tracking, launching, the CLI, reports or
  benchmarks;
* the config (and the generic options parser) do not import the methods;
* no method imports torch.distributed (counted traffic goes through the Communicator, the rest
  through the context's control channel);
* no algorithms module imports a method's module (a file named after the method it registers):
  shared code lives in shared modules;
* nothing outside ``core`` reaches a private member of a Communicator (``comm._...``);
* no production module imports the test kit (``commlab.testing``).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in (SRC / "commlab").rglob("*.py")}


def _known(name: str) -> str | None:
    """The longest prefix of ``name`` that is a commlab module."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in MODULES:
            return candidate
    return None


def imports_of(name: str, path: Path) -> set[str]:
    """The commlab modules ``name`` imports anywhere in its file (module or function level)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the module pkg.sub when there is one
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found.update(t for t in map(_known, targets) if t and t != name)
    return found


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(packages: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{m} imports {t}" for m, targets in GRAPH.items() if any(_inside(m, p) for p in packages)
                  for t in targets if any(_inside(t, f) for f in forbidden))


def test_the_checker_sees_a_cycle_and_the_imports_it_must():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    # module-level, function-level and relative imports are all seen
    assert "commlab.loop.loop" in GRAPH["commlab.loop.worker"]  # imported inside a function
    assert "commlab.launch.netem" in GRAPH["commlab.launch.supervise"]
    assert {"commlab.core.communicator", "commlab.core.stats"} <= GRAPH["commlab.core"]


def test_no_import_cycle():
    assert find_cycle(GRAPH) is None, " -> ".join(find_cycle(GRAPH))


def test_core_imports_only_core():
    outside = sorted(f"{m} imports {t}" for m, targets in GRAPH.items() if _inside(m, "commlab.core")
                     for t in targets if not _inside(t, "commlab.core"))
    assert outside == []


#: commlab's packages and top-level modules, bottom layer first: a module imports from its own
#: layer and those below, never from one above (docs/architecture.md, "The layers"). A new package
#: or top-level module takes its place here.
LAYERS = (
    ("commlab", "commlab.core", "commlab.registry", "commlab.options", "commlab.malloc", "commlab.provenance",
     "commlab.timeline"),
    ("commlab.compress", "commlab.data", "commlab.models"),
    ("commlab.algorithms", "commlab.config", "commlab.grid"),
    ("commlab.tracking", "commlab.tracking_relay"),
    ("commlab.loop",),
    ("commlab.launch",),
    ("commlab.bench", "commlab.testing"),
    ("commlab.report",),
    ("commlab.cli", "commlab.__main__"),
)


def imports_up(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Each import in ``graph`` of a package or top-level module from a layer above the importer's
    (``m imports t``); a module's place is its first two name parts (``commlab.loop.heap``: ``commlab.loop``)."""
    level = {unit: i for i, layer in enumerate(layers) for unit in layer}

    def place(module: str) -> int:
        return level[".".join(module.split(".")[:2])]

    return sorted(f"{m} imports {t}" for m, targets in graph.items() for t in targets if place(t) > place(m))


def test_no_module_imports_a_layer_above():
    layers = (("commlab", "commlab.low"), ("commlab.high",))
    assert imports_up({"commlab.low.a": {"commlab.high.b", "commlab.low.c"}, "commlab.high.b": {"commlab.low.c"},
                       "commlab.low.c": {"commlab"}}, layers) == ["commlab.low.a imports commlab.high.b"]
    placed = [unit for layer in LAYERS for unit in layer]
    assert sorted(placed) == sorted({".".join(name.split(".")[:2]) for name in MODULES})  # each once
    assert imports_up(GRAPH, LAYERS) == []


def test_methods_and_compressors_never_import_the_layers_above():
    above = tuple(f"commlab.{p}" for p in ("loop", "tracking", "launch", "cli", "report", "bench"))
    assert _violations(("commlab.compress", "commlab.algorithms"), above) == []


def test_config_does_not_import_the_methods():
    below = ("commlab.config", "commlab.options", "commlab.registry", "commlab.grid")
    assert _violations(below, ("commlab.algorithms", "commlab.compress", "commlab.loop")) == []


TESTS = Path(__file__).resolve().parent


def distributed_uses(tree: ast.AST) -> list[str]:
    """Where ``tree`` imports torch.distributed or reaches it as ``torch.distributed`` (line: what)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if _inside(a.name, "torch.distributed")]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if _inside(node.module, "torch.distributed") or (
                    node.module == "torch" and any(a.name == "distributed" for a in node.names)):
                found.append(f"{node.lineno}: from {node.module} import ...")
        elif (isinstance(node, ast.Attribute) and node.attr == "distributed" and isinstance(node.value, ast.Name)
              and node.value.id == "torch"):
            found.append(f"{node.lineno}: torch.distributed")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def private_comm_members(tree: ast.AST) -> list[str]:
    """Where ``tree`` reads a private member (``_name``, not ``__dunder__``) of an object named
    like a communicator (``comm``, ``self.comm``, ``group_comm``, ...): line: member."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
        if name.lower().endswith("comm"):
            found.append(f"{node.lineno}: {name}.{node.attr}")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def test_the_checkers_see_what_they_must():
    sample = ast.parse("import torch.distributed as dist\nfrom torch import distributed\n"
                       "from torch.distributed import ReduceOp\nx = torch.distributed.get_rank()\n"
                       "import torch.nn\nfrom torch.nn.parallel import DistributedDataParallel\n")
    assert [line.split(":")[0] for line in distributed_uses(sample)] == ["1", "2", "3", "4"]
    sample = ast.parse("self.comm._count_device()\ncomm._global_ranks\nself.group_comm._record(1)\n"
                       "self._comm.all_reduce(x)\ncomm.__class__\nself.comm.device\n")
    assert private_comm_members(sample) == ["1: comm._count_device", "2: comm._global_ranks",
                                            "3: group_comm._record"]


def test_methods_never_import_torch_distributed():
    uses = {name: distributed_uses(ast.parse(path.read_text())) for name, path in MODULES.items()
            if _inside(name, "commlab.algorithms")}
    assert {name: found for name, found in uses.items() if found} == {}


def test_nothing_outside_core_reaches_a_private_communicator_member():
    files = [p for name, p in MODULES.items() if not _inside(name, "commlab.core")] + sorted(TESTS.glob("*.py"))
    found = {str(p): private_comm_members(ast.parse(p.read_text())) for p in files}
    assert {path: members for path, members in found.items() if members} == {}


def test_production_code_never_imports_the_test_kit():
    found = sorted(f"{m} imports {t}" for m, targets in GRAPH.items() if not _inside(m, "commlab.testing")
                   for t in targets if _inside(t, "commlab.testing"))
    assert found == []


def registered_method_modules() -> set[str]:
    """The modules of ``commlab.algorithms`` named after the method they register
    (``@ALGORITHMS.register("name")`` on a class of ``name.py``), read from the source."""
    found = set()
    for name, path in MODULES.items():
        if not _inside(name, "commlab.algorithms"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            for decorator in getattr(node, "decorator_list", []):
                if (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
                        and decorator.func.attr == "register" and isinstance(decorator.func.value, ast.Name)
                        and decorator.func.value.id == "ALGORITHMS" and decorator.args
                        and isinstance(decorator.args[0], ast.Constant) and decorator.args[0].value == path.stem):
                    found.add(name)
    return found


def test_no_method_module_imports_another_method_module():
    # Shared code lives in shared modules (periodic, outer, ...); a method's file is its own, so
    # one method built on another's module would change when that one changes.
    from commlab.registry import ALGORITHMS

    methods = registered_method_modules()
    # the source says what the registry says (no method registered out of the checker's sight)
    assert methods == {f"commlab.algorithms.{name}" for name in ALGORITHMS.package_names()}
    found = sorted(f"{m} imports {t}" for m, targets in GRAPH.items() if _inside(m, "commlab.algorithms")
                   for t in targets if t in methods)
    assert found == []
