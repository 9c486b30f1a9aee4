"""An input error raised inside the ranks reaches the user as one line: from rank 0 when every
rank hit it, and from the rank that hit it alone (tagged with its rank) when rank 0 did not, so
that it does not vanish while the other ranks wait in a collective."""
from __future__ import annotations

import contextlib
import io

from harness import run_distributed


def _report(ctx, raising_ranks):
    from etp.train.launch import report_input_error

    err = io.StringIO()
    if ctx.rank in raising_ranks:
        with contextlib.redirect_stderr(err):
            report_input_error(ctx.rank, ValueError("seq_length=7: must divide by 8"), wait_s=1.0)
    return err.getvalue()


def test_an_error_every_rank_hit_is_one_line_from_rank_zero():
    printed = run_distributed(_report, 2, (0, 1))
    assert printed == ["etp-train: error: seq_length=7: must divide by 8\n", ""]


def test_an_error_only_another_rank_hit_is_printed_by_that_rank():
    printed = run_distributed(_report, 2, (1,))
    assert printed == ["", "etp-train: error (rank 1): seq_length=7: must divide by 8\n"]
