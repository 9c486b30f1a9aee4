"""The ``provenance`` block every tool writes into its JSON: ``etp.provenance.run_provenance()``
with, under torchrun, the command as typed (``torchrun ... tools/x.py ...``) rather than the
worker's own ``python3 tools/x.py ...``, so the block's command reproduces the run.
"""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # etp from this checkout

from etp.provenance import run_provenance  # noqa: E402

__all__ = ["provenance"]


def provenance(argv: list[str] | None = None) -> dict:
    """``run_provenance()`` of this process, its command rewritten for a torchrun worker.

    Example::

        report = {"results": ..., "provenance": provenance()}
    """
    found = run_provenance(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun in every worker
        args = sys.argv if argv is None else argv
        launcher = ["torchrun", "--standalone", f"--nproc-per-node={os.environ.get('LOCAL_WORLD_SIZE', '1')}"]
        found["command"] = shlex.join([*launcher, *args])
    return found
