"""Name -> factory registries for methods, models, datasets and benchmarks.

A new method is one module, named after it, plus one ``@ALGORITHMS.register("name")`` line on its
class (which declares its traits: :class:`commlab.algorithms.base.Algorithm`); the package imports
its modules on first lookup (no if/elif factories anywhere).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any


class Registry:
    """A mapping from names to factories, filled by decorators in the modules of one package."""

    def __init__(self, kind: str, package: str):
        self.kind = kind
        self.package = package
        self._entries: dict[str, Any] = {}
        self._loaded = False

    def register(self, name: str) -> Callable[[Any], Any]:
        def decorate(obj: Any) -> Any:
            if name in self._entries and self._entries[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = obj
            return obj

        return decorate

    def _load(self) -> None:
        if self._loaded:
            return
        pkg = importlib.import_module(self.package)
        for info in pkgutil.iter_modules(pkg.__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"{self.package}.{info.name}")
        self._loaded = True

    def get(self, name: str) -> Any:
        self._load()
        if name not in self._entries:
            raise ValueError(
                f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._entries))}"
            )
        return self._entries[name]

    def names(self) -> list[str]:
        self._load()
        return sorted(self._entries)

    def package_names(self) -> list[str]:
        """The names the package's own modules register, without those of plugins (modules
        outside it that a run config or a test imported into this process)."""
        self._load()
        return sorted(name for name, obj in self._entries.items()
                      if getattr(obj, "__module__", "").startswith(self.package + "."))

    def __contains__(self, name: str) -> bool:
        self._load()
        return name in self._entries


ALGORITHMS = Registry("method", "commlab.algorithms")
MODELS = Registry("model", "commlab.models")
DATASETS = Registry("dataset", "commlab.data")
BENCHMARKS = Registry("benchmark", "commlab.bench")
SELECTORS = Registry("selector", "commlab.compress")
