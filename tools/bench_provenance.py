"""The ``provenance`` block every tool writes into its JSON (``etp.provenance.run_provenance``),
importable from tools/ with this checkout's etp first on the path."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # etp from this checkout

from etp.provenance import run_provenance  # noqa: E402

__all__ = ["provenance"]


def provenance(argv: list[str] | None = None) -> dict:
    """``etp.provenance.run_provenance()`` (the command as typed, under torchrun too).

    Example::

        report = {"results": ..., "provenance": provenance()}
    """
    return run_provenance(argv)
