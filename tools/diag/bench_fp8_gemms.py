#!/usr/bin/env python
"""The expert stack's six grouped GEMMs (tools/bench_expert_stack.py shapes: 16 experts x 2048
tokens, hidden 4096, ffn 1536) in bf16 (``torch._grouped_mm``) and FP8
(``torch._scaled_grouped_mm``, rowwise activation scales, per-expert weight scales) with the
promoted accumulation and with fast accumulation (what etp's FP8 GEMMs always use), the weight
gradients also as FP8 2-D x 2-D GEMMs on per-(expert, column) scaled operands
(``ETPConfig.fp8_wgrad``; etp's operand quantization per column and per expert, timed and
with its error, also on inputs with outlier features). Each: median device ms of 20 after 5 warm-up, TFLOP/s, and the
relative error (Frobenius) of expert 0's result against float64 on the unquantized inputs.
Also the eager SwiGLU and a copy of the same bytes, for scale.

    python3 tools/diag/bench_fp8_gemms.py --out $OUT/bench_fp8_gemms.json      # one sm90 GPU
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: bench_provenance

from bench_provenance import provenance  # noqa: E402 - puts this checkout's etp first on the path

from etp.kernels import quantize_grouped_colwise  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_fp8_gemms.json"))
args = parser.parse_args()
if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9):
    raise SystemExit("bench_fp8_gemms.py needs an sm90+ GPU (FP8 tensor cores)")

E, TPE, H, FFN = 16, 2048, 4096, 1536
T = E * TPE
dev = "cuda"
torch.manual_seed(0)
F8 = torch.float8_e4m3fn
offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * TPE
counts = torch.full((E,), TPE, device=dev, dtype=torch.int64)


def timed(fn, *fn_args, iters=20, warm=5, **fn_kwargs):
    """Median device ms of ``fn(*fn_args, **fn_kwargs)``."""
    def call():
        return fn(*fn_args, **fn_kwargs)
    for _ in range(warm):
        call()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        torch.cuda._sleep(2_000_000)
        s.record()
        call()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def q_rows(x):  # rowwise e4m3
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
    scale = 448.0 / amax
    return (x.float() * scale).clamp(-448, 448).to(F8), (1.0 / scale).squeeze(-1).contiguous()


def q_experts(w):  # per expert tensorwise
    amax = w.abs().amax(dim=(1, 2)).float()
    scale = 448.0 / amax
    return (w.float() * scale[:, None, None]).to(F8), (1.0 / scale).contiguous()


res = {}
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16) * 0.5
w1 = torch.randn(E, 2 * FFN, H, device=dev, dtype=torch.bfloat16) * 0.02
w2 = torch.randn(E, H, FFN, device=dev, dtype=torch.bfloat16) * 0.02
a = torch.randn(T, FFN, device=dev, dtype=torch.bfloat16)
gy = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
g1 = torch.randn(T, 2 * FFN, device=dev, dtype=torch.bfloat16)

cases = {  # name: (A [M,K] row-major, W [E, N, K] (fwd: y = A W^T), flops)
    "fc1_fwd": (x, w1), "fc2_fwd": (a, w2),
    "fc2_dgrad": (gy, w2.transpose(1, 2).contiguous()), "fc1_dgrad": (g1, w1.transpose(1, 2).contiguous()),
}
for name, (A, W) in cases.items():
    flops = 2 * A.shape[0] * A.shape[1] * W.shape[1]
    tb = timed(torch._grouped_mm, A, W.transpose(-2, -1), offs=offs)
    Aq, As = q_rows(A)
    Wq, Ws = q_experts(W)
    sb = Ws[:, None].expand(E, W.shape[1]).contiguous()
    row = {"bf16_ms": tb, "bf16_tflops": flops / tb / 1e9}
    for fast in (False, True):
        tf = timed(torch._scaled_grouped_mm, Aq, Wq.transpose(-2, -1), As, sb, offs=offs,
                   out_dtype=torch.bfloat16, use_fast_accum=fast)
        row[f"fp8_fast{int(fast)}_ms"] = tf
        row[f"fp8_fast{int(fast)}_tflops"] = flops / tf / 1e9
    # accuracy on expert 0 vs float64
    ref = (A[:TPE].double() @ W[0].double().t())
    yb = torch._grouped_mm(A, W.transpose(-2, -1), offs=offs)[:TPE].double()
    row["bf16_relerr"] = ((yb - ref).norm() / ref.norm()).item()
    for fast in (False, True):
        yf = torch._scaled_grouped_mm(Aq, Wq.transpose(-2, -1), As, sb, offs=offs, out_dtype=torch.bfloat16,
                                      use_fast_accum=fast)[:TPE].double()
        row[f"fp8_fast{int(fast)}_relerr"] = ((yf - ref).norm() / ref.norm()).item()
    res[name] = row
    print(name, json.dumps({k: round(v, 5) for k, v in row.items()}), flush=True)

# wgrad: dW[e] = G_e^T X_e, G [T, N], X [T, K]
for name, (G, X) in {"fc1_wgrad": (g1, x), "fc2_wgrad": (gy, a)}.items():
    flops = 2 * T * G.shape[1] * X.shape[1]
    tb = timed(torch._grouped_mm, G.t(), X, offs=offs)
    row = {"bf16_ms": tb, "bf16_tflops": flops / tb / 1e9}
    # per (expert, feature) scales over the expert's tokens: A = G^T [N, T] row-major, B = X [T, K] col-major
    def colq(M):
        Mt = M.t().contiguous()  # [F, T]
        amax = torch.stack([Mt[:, e * TPE:(e + 1) * TPE].abs().amax(dim=1) for e in range(E)]).float().clamp_min(1e-12)
        scale = 448.0 / amax  # [E, F]
        q = torch.empty_like(Mt, dtype=F8)
        for e in range(E):
            q[:, e * TPE:(e + 1) * TPE] = (Mt[:, e * TPE:(e + 1) * TPE].float() * scale[e][:, None]).to(F8)
        return q, (1.0 / scale).reshape(-1).contiguous()
    Gq, Gs = colq(G)
    Xq, Xs = colq(X)
    try:
        for fast in (False, True):
            tf = timed(torch._scaled_grouped_mm, Gq, Xq.t(), Gs, Xs, offs=offs, out_dtype=torch.bfloat16,
                       use_fast_accum=fast)
            row[f"fp8_fast{int(fast)}_ms"] = tf
            row[f"fp8_fast{int(fast)}_tflops"] = flops / tf / 1e9
        ref = G[:TPE].double().t() @ X[:TPE].double()
        yf = torch._scaled_grouped_mm(Gq, Xq.t(), Gs, Xs, offs=offs, out_dtype=torch.bfloat16)[0].double()
        yb = torch._grouped_mm(G.t(), X, offs=offs)[0].double()
        row["bf16_relerr"] = ((yb - ref).norm() / ref.norm()).item()
        row["fp8_relerr"] = ((yf - ref).norm() / ref.norm()).item()
        # etp's own operand quantization (ETPConfig.fp8_wgrad): per (expert, column), and per
        # expert from the rows' amax the forward / input-gradient GEMMs' rowwise pass left
        # behind; the error also on X with 8 outlier feature columns (x100, the "massive
        # activations" of trained LLMs), where a per-expert scale is set by the outliers.
        X_out = X.clone()
        X_out[:, :: X.shape[1] // 8] *= 100
        amaxes = {id(M): M.abs().amax(dim=1).float() for M in (G, X, X_out)}  # made by the rowwise pass in etp
        for mode in ("per_column", "per_expert"):
            def etp_operands(M, mode=mode, amaxes=amaxes):
                return quantize_grouped_colwise(M, counts, row_amax=amaxes[id(M)] if mode == "per_expert" else None)
            # both operands' quantization (the amax is not timed: the rowwise pass made it)
            row[f"etp_{mode}_quantize_ms"] = timed(lambda f, a, b: (f(a), f(b)), etp_operands, G, X)
            gq, gs, po = etp_operands(G)
            for label, XX in (("", X), ("_outliers", X_out)):
                xq, xs, _ = etp_operands(XX)
                yf = torch._scaled_grouped_mm(gq, xq.t(), gs.reshape(-1), xs.reshape(-1), offs=po,
                                              out_dtype=torch.bfloat16, use_fast_accum=True)[0].double()
                ref = G[:TPE].double().t() @ XX[:TPE].double()
                row[f"etp_{mode}{label}_relerr"] = ((yf - ref).norm() / ref.norm()).item()
    except Exception as exc:  # noqa: BLE001
        row["error"] = repr(exc)[:300]
    res[name] = row
    print(name, json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)

# elementwise reference points: silu*mul fwd, copy of the same bytes
gu = torch.randn(T, 2 * FFN, device=dev, dtype=torch.bfloat16)
res["swiglu_eager_ms"] = timed(lambda: torch.nn.functional.silu(gu[:, :FFN]) * gu[:, FFN:])
res["copy_gu_ms"] = timed(gu.clone)
print("swiglu", res["swiglu_eager_ms"], "copy", res["copy_gu_ms"], flush=True)
res["provenance"] = provenance()
with open(args.out, "w") as f:
    json.dump(res, f, indent=1)
print("JSON:", args.out)
