"""megatron-core integration of etp. megatron-core is imported lazily, only where needed.

ETP groups inside megatron-core's data-parallel groups (``groups``), the TP-linear plug
point (``layers``), ``apply_etp`` and the grouped-experts ModuleSpec (``model``),
megatron-core DDP / optimizer / finalize for ETP models (``ddp``, ``optimizer``,
``finalize``: import them explicitly, they import megatron-core), the Megatron-LM flags
(``args``), every patch of megatron-core internals (``patches``) and the readers of what the
supported megatron-core versions name differently (``compat``). Recipes live in
:mod:`etp.recipe`, the trainer in :mod:`etp.train`.
"""
from etp._moved import forward as _forward

from . import (
    layers,  # noqa: F401  (registers megatron-core's TP linears with etp.wrap)
    patches,  # noqa: F401  (checks the megatron-core version these patches support)
)
from .args import add_etp_args, etp_config_from_args

__all__ = ["add_etp_args", "etp_config_from_args"]

#: ``Recipe`` / ``RecipeError`` moved to :mod:`etp.recipe`.
__getattr__ = _forward(__name__, "etp.recipe", ("Recipe", "RecipeError"))
