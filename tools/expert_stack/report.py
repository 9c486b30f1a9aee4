"""Figures derived from the measured variants, and the tables printed on rank 0."""
from __future__ import annotations

from .variants import VARIANTS

__all__ = ["add_derived", "checks_line", "gather_table", "variants_table"]


def add_derived(results: dict, flops: float) -> None:
    """Per ok variant: TFLOP/s per GPU, throughput against ``replicated`` (its step time over
    this one's: above 1 is faster), exposed communication (ms over ``replicated``) and the
    check's relative difference from ``replicated``'s."""
    base = results.get("replicated", {})
    base_ms = base.get("step_ms") if base.get("status") == "ok" else None
    base_check = base.get("check") if base_ms else None
    for r in results.values():
        if r.get("status") != "ok":
            continue
        r["tflops_per_gpu"] = flops / (r["step_ms"] * 1e-3) / 1e12
        r["throughput_vs_replicated"] = base_ms / r["step_ms"] if base_ms else None
        r["exposed_comm_ms"] = r["step_ms"] - base_ms if base_ms else None
        r["check_rel_diff_vs_replicated"] = (
            {k: abs(r["check"][k] - base_check[k]) / abs(base_check[k]) if base_check[k] else None
             for k in ("output_sum", "grad_norm")} if base_check else None)


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def variants_table(results: dict) -> str:
    """One row per variant: mean step ms, the rounds' spread, throughput against replicated,
    TFLOP/s, peak memory, bytes received per step."""
    lines = ["| variant | step ms (mean) | spread of rounds | x replicated throughput | TFLOP/s/GPU | peak GiB "
             "| wire GB/step |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        if r.get("status") != "ok":
            lines.append(f"| {name} | {r['status'].replace('|', '/')[:100]} | | | | | |")
            continue
        lines.append(
            f"| {name} | {r['step_ms']:.2f} | {100 * r['round_spread']:.1f}% | {_fmt(r['throughput_vs_replicated'], '.3f')} "
            f"| {r['tflops_per_gpu']:.1f} | {_fmt(r['peak_allocated_gib'], '.2f')} "
            f"| {r['wire_bytes_per_step_per_rank'] / 1e9:.3f} |")
    return "\n".join(lines)


def checks_line(results: dict) -> str:
    parts = []
    for name, r in results.items():
        if r.get("status") != "ok":
            continue
        part = f"{name} {r['check']['output_sum']:.6g} / {r['check']['grad_norm']:.6g}"
        rel = r.get("check_rel_diff_vs_replicated")
        if VARIANTS[name].fp8 and rel:
            part += f" (FP8: {_fmt(rel['output_sum'], '.1e')} / {_fmt(rel['grad_norm'], '.1e')} off replicated)"
        parts.append(part)
    return ("checks (output sum over ranks / mean-gradient norm; bf16 variants agree up to rounding, FP8 ones "
            "up to FP8 rounding): " + ", ".join(parts))


def gather_table(section: dict) -> str:
    if section.get("status") != "ok":
        return f"gather bandwidth: {section.get('status')}"
    lines = [f"| gather of {section['tensor']}, W={section['group_size']} | median ms | busbw GB/s |",
             "|---|---:|---:|"]
    for key, e in section["entries"].items():
        if e.get("status") != "ok":
            lines.append(f"| {key} | {e['status'].replace('|', '/')[:100]} | |")
        else:
            lines.append(f"| {e['what']} | {e['median_ms']:.3f} | {e['busbw_gbps']:.1f} |")
    lines.append(f"\netp / raw busbw: FP8 {_fmt(section['etp_fp8_over_raw_busbw'], '.3f')}, "
                 f"bf16 {_fmt(section['etp_bf16_over_raw_busbw'], '.3f')}")
    return "\n".join(lines)
