"""User code named in the spec as ``module.path:function`` (rewards, tools): imported once at start-up, with a
one-line error naming the spec field when it cannot be."""
from __future__ import annotations

import importlib
from collections.abc import Callable


def import_function(path: str, field: str, error: type[Exception] = ValueError) -> Callable:
    """``module.path:function`` -> the callable; ``error`` naming ``field`` and what is wrong otherwise."""
    if ":" not in path:
        raise error(f"{field} {path!r} must be module.path:function")
    module_name, func_name = path.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is a configuration error
        raise error(f"{field} {path!r}: cannot import module {module_name!r}: {exc}") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise error(f"{field} {path!r}: module {module_name!r} has no function {func_name!r}")
    return func
