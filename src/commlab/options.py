"""Typed options from a config mapping: a dataclass built from ``{key: value}``, each value
coerced to its field's type, every bad key or value named.

Each method declares its options as a dataclass (``Algorithm.Options``); the config validates
``method_params`` through :func:`parse_options` once, before any worker starts, and the loop
receives the parsed object. Generic: neither the config nor the methods depend on each other here.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any


def parse_options(options_cls: type, params: dict | None, where: str = "method_params") -> Any:
    """Build a method's Options dataclass from a config dict, naming any bad key or value."""
    params = dict(params or {})
    fields = {f.name: f for f in dataclasses.fields(options_cls)}
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise ValueError(
            f"{where}: unknown option(s) {unknown} for this method; known: {sorted(fields)}"
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
            raise ValueError(f"{where}: {err}") from None
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
