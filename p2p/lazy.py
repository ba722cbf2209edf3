"""Packages that import their parts on first use (PEP 562), so that a command imports only what it runs.

``dedloc --help`` and ``dedloc id`` must not pay for torch (1.3 s) or
py-libp2p (0.7 s): a package's ``__init__`` names its exports here instead of
importing them, and keeps the imports under ``TYPE_CHECKING`` for the type
checker. ``from nat import Peer`` works as before; it imports ``nat.peer``
then, not when ``nat.commands`` is imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def exports(package: str, where: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: name -> the relative module that defines it."""
    module = importlib.import_module(package)

    def __getattr__(name: str) -> Any:
        source = where.get(name)
        if source is None:
            # A submodule, as an eager __init__ would have imported it on the way (``averaging.staging``).
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(source, package), name)
        setattr(module, name, value)  # the next access is a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(module), *where})

    return __getattr__, __dir__


__all__ = ["exports"]
