"""Import aliases for names that moved: the old module path keeps working for one release and
says where the name went (a ``DeprecationWarning`` on each use).

An alias module holds nothing but its docstring and ``__getattr__ = forward(__name__, NEW)``
(plus, for a command, the lines that run it): ``tests/test_architecture.py`` checks that shape,
so no code can hide in one, and leaves the aliases out of the import graph.

Example::

    # etp/megatron/recipe/__init__.py
    from etp._moved import forward
    __getattr__ = forward(__name__, "etp.recipe")
"""
from __future__ import annotations

import importlib
import warnings


def forward(old: str, new: str, names: tuple[str, ...] | None = None):
    """A module ``__getattr__`` that hands out ``new``'s attributes (all, or only ``names``)
    under ``old`` with a warning."""

    def __getattr__(name: str):
        if name.startswith("__") or (names is not None and name not in names):
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(f"{old}.{name} moved to {new}.{name}; import it from there ({old} goes in the next release)",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new), name)

    return __getattr__
