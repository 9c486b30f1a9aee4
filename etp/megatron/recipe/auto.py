"""Deprecated alias: ``auto`` moved to :mod:`etp.train.auto`."""
from etp._moved import forward

__getattr__ = forward(__name__, "etp.train.auto")
