"""megatron-core integration of etp. megatron-core is imported lazily, only where needed.

ETP groups inside megatron-core's data-parallel groups (``groups``), the TP-linear plug
point (``layers``), ``apply_etp`` and the grouped-experts ModuleSpec (``model``),
megatron-core DDP / optimizer / finalize for ETP models (``ddp``, ``optimizer``,
``finalize``: import them explicitly, they import megatron-core), recipe parsing and
validation (``recipe``) and the Megatron-LM flags (``args``).
"""
from . import layers  # noqa: F401  (registers megatron-core's TP linears with etp.wrap)
from .args import add_etp_args, etp_config_from_args
from .recipe import Recipe, RecipeError

__all__ = ["Recipe", "RecipeError", "add_etp_args", "etp_config_from_args"]
