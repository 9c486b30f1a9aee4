"""megatron-core integration of etp. megatron-core is imported lazily, only where needed.

So far: ETP groups inside megatron-core's data-parallel groups (``groups``), the TP-linear
plug point (``layers``), ``apply_etp`` and the grouped-experts ModuleSpec (``model``, which
imports megatron-core: import it explicitly), recipe parsing and validation (``recipe``)
and the Megatron-LM flags (``args``).
"""
from .args import add_etp_args, etp_config_from_args
from .recipe import Recipe, RecipeError

__all__ = ["Recipe", "RecipeError", "add_etp_args", "etp_config_from_args"]
