"""Typed options from a config mapping: a dataclass built from ``{key: value}``, each value
coerced to its field's type, every bad key or value named.

Each method declares its options as a dataclass (``Algorithm.Options``); the config validates
``method_params`` through :func:`parse_options` once, before any worker starts, and the loop
receives the parsed object. Generic: neither the config nor the methods depend on each other here.

An Options class may accept other names for some of its fields (a paper's names), declared as
``ALIASES: ClassVar[dict[str, Alias]]``; a config may give a field or one alias of it, not both.

Example::

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Options:
    ...     period: int = 16
    ...     buffers: str = "average"
    >>> Options.ALIASES = {"k": Alias("period"),    # in a method: ALIASES: ClassVar[...] = {...}
    ...                    "average_buffers": Alias("buffers", {True: "average", False: "keep_local"})}
    >>> parse_options(Options, {"k": 4, "average_buffers": False})
    Options(period=4, buffers='keep_local')
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Alias:
    """Another name of an Options field, accepted in configs and grids.

    Args:
        field: the field it stands for.
        values: the alias's values and the field's value each one means (None: the same value).
    """

    field: str
    values: dict | None = None

    def value(self, value: Any, where: str) -> Any:
        """The field's value for the alias's ``value``, naming ``where`` if it is not one of ``values``."""
        if self.values is None:
            return value
        for key, meant in self.values.items():
            if type(key) is type(value) and key == value:
                return meant
        raise ValueError(f"{where}: expected one of {list(self.values)}, got {value!r}")


def parse_options(options_cls: type, params: dict | None, where: str = "method_params") -> Any:
    """Build a method's Options dataclass from a config dict, naming any bad key or value."""
    params = dict(params or {})
    fields = {f.name: f for f in dataclasses.fields(options_cls)}
    aliases: dict[str, Alias] = getattr(options_cls, "ALIASES", {})
    given_as = {}  # field -> the alias the config used for it
    for alias, target in aliases.items():
        if alias in params:
            if target.field in params:
                raise ValueError(f"{where}: {alias} is an alias of {target.field}: give one of them, not both")
            params[target.field] = target.value(params.pop(alias), f"{where}.{alias}")
            given_as[target.field] = alias
    unknown = sorted(set(params) - set(fields))
    if unknown:
        also = f" (or the aliases {sorted(aliases)})" if aliases else ""
        raise ValueError(
            f"{where}: unknown option(s) {unknown} for this method; known: {sorted(fields)}{also}"
        )
    hints = typing.get_type_hints(options_cls)
    for key, value in params.items():
        params[key] = _coerce(value, hints.get(key), f"{where}.{key}")
    options = options_cls(**params)
    check = getattr(options, "validate", None)
    if check is not None:
        try:
            check()
        except ValueError as err:
            named = [f"{alias} is an alias of {field}" for field, alias in given_as.items()
                     if re.search(rf"\b{field}\b", str(err))]
            raise ValueError(f"{where}: {err}" + (f" ({'; '.join(named)})" if named else "")) from None
    return options


def _coerce(value: Any, hint: Any, where: str) -> Any:
    if value is None or hint is None:
        return value
    base = typing.get_origin(hint) or hint
    args = typing.get_args(hint)
    if base in (typing.Union, types.UnionType):
        for h in args:
            if h is type(None):
                continue
            try:
                return _coerce(value, h, where)
            except ValueError:
                continue
        raise ValueError(f"{where}: {value!r} is not a valid value")
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            raise ValueError
        if base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if base is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if base is str:
            if not isinstance(value, str):
                raise ValueError
            return value
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected {getattr(base, '__name__', base)}, got {value!r}") from None
    return value
