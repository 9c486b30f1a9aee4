"""Deprecated alias: recipes moved to :mod:`etp.recipe`."""
from etp._moved import forward

__getattr__ = forward(__name__, "etp.recipe")
