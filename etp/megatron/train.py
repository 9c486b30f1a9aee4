"""Deprecated alias: the ``etp-train`` command moved to :mod:`etp.train` (``python -m etp.train``)."""
from etp._moved import forward

__getattr__ = forward(__name__, "etp.train.main")

if __name__ == "__main__":
    import sys

    sys.exit(__getattr__("main")())
