"""Ticketed weight-buffer cache and the bounded wgrad scratch pool."""
from .weight_cache import BufferKey, Role, WeightCache
from .wgrad_pool import WgradPool

__all__ = ["BufferKey", "Role", "WeightCache", "WgradPool"]
