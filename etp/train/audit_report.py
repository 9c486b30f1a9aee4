"""etp-train's memory-audit output: every rank's ``MemoryAudit`` against ``etp-audit``'s
prediction, with the gather transport the run's ETP runtime chose."""
from __future__ import annotations

import torch.distributed as dist

__all__ = ["gather_transport_of", "write_audit"]


def gather_transport_of(model) -> str | None:
    """The gather transport the ETP runtime of ``model`` chose (None without ETP weights)."""
    from etp.wrap import _runtime_of

    runtime = _runtime_of(model)
    names = {t.gather.name for t in runtime.transports.values()} if runtime is not None else set()
    return names.pop() if len(names) == 1 else None


def write_audit(path, audit, recipe, world: int, rank: int, transport: str | None = None) -> None:
    """Gathers every rank's audit to rank 0, which prints its own table against the
    prediction and writes all of them (a collective)."""
    import json

    from etp.audit import predict_memory, predict_peak

    prediction = predict_memory(recipe, world)
    peak = predict_peak(recipe, world, transport=transport)
    report = audit.report()
    measured = [r["peak_allocated"] for r in report["phases"].values() if r.get("peak_allocated") is not None]
    peaks = {"predicted": peak["peak"], "predicted_phase": peak["peak_phase"],
             "measured": max(measured) if measured else None}
    mine = {"report": report, "comparison": audit.compare(prediction), "peak": peaks}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return
    print(audit.format_table(prediction), flush=True)
    if peaks["measured"] is not None:
        print(f"peak allocated: measured {peaks['measured'] / 2**30:.2f} GiB, predicted {peak['peak'] / 2**30:.2f} GiB "
              f"({peaks['measured'] / peak['peak'] - 1:+.1%}; predicted in {peak['peak_phase']})", flush=True)
    with open(path, "w") as f:
        json.dump({"recipe": str(recipe.source), "world_size": world, "prediction": prediction,
                   "ranks": everyone}, f, indent=1, default=str)
    print(f"etp-train: wrote the memory audit of {world} ranks to {path}", flush=True)
