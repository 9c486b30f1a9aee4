"""The order of ETP's backward for one weight (etp/autograd.py): the weight is acquired first
(that issues the next weight's gather), then the weight gradient is computed and handed to
the reduce-scatter, and the input gradient comes last, so the reduction overlaps it. Numerics
are covered by the parity tests; this pins the order, which they cannot see."""
from types import SimpleNamespace

import torch

from etp.autograd import _ETPWeightFunction
from etp.config import ETPConfig
from etp.gemm import row_amax


def _ctx(log, needs_x=True, needs_w=True, fp8_wgrad=False, x_row_amax=None, seen=None, gather_dtype=None):
    x, gy = torch.ones(4, 3), torch.ones(4, 2)
    runtime = SimpleNamespace(
        acquire=lambda param, role, dtype: log.append("acquire") or torch.ones(2, 3),
        wgrad_buffer=lambda param: log.append("wgrad_buffer") or torch.zeros(2, 3),
        reduce_grad=lambda param, buffer: log.append("reduce_grad"),
    )
    gather_dtype = gather_dtype or ("fp8_tensorwise" if fp8_wgrad else "param")
    param = SimpleNamespace(etp_runtime=runtime, etp_config=ETPConfig(fp8_wgrad=fp8_wgrad, gather_dtype=gather_dtype),
                            etp_layout=SimpleNamespace(unpad=lambda t: t))
    op = SimpleNamespace(
        dgrad=lambda g, w, counts: log.append("dgrad") or g @ w,
        wgrad=lambda g, x, counts, out=None, **kw: log.append(f"wgrad fp8={kw.get('fp8')}") or (seen if seen is not None else []).append(row_amax(x)) or out,
        writes_into=lambda x, g: True,
        quantize_ahead=lambda g, w, counts: log.append("quantize_ahead"),
    )
    return SimpleNamespace(saved_tensors=(x, None), param=param, op=op, x_row_amax=x_row_amax,
                           needs_input_grad=(needs_x, needs_w, False, False, False)), gy


def test_weight_gradient_is_reduced_before_the_input_gradient():
    log = []
    ctx, gy = _ctx(log)
    grad_x, *rest = _ETPWeightFunction.backward(ctx, gy)
    assert log == ["acquire", "wgrad_buffer", "wgrad fp8=False", "reduce_grad", "dgrad"]
    assert grad_x.shape == (4, 3) and rest == [None] * 4


def test_fp8_wgrad_quantizes_the_gradient_ahead_and_no_weight_without_input_gradient():
    log = []
    ctx, gy = _ctx(log, fp8_wgrad=True)
    _ETPWeightFunction.backward(ctx, gy)
    assert log == ["acquire", "quantize_ahead", "wgrad_buffer", "wgrad fp8=True", "reduce_grad", "dgrad"]
    log.clear()
    ctx, gy = _ctx(log, needs_x=False, fp8_wgrad=True)  # e.g. a first layer's input: no dgrad
    grad_x, *_ = _ETPWeightFunction.backward(ctx, gy)
    assert grad_x is None and log == ["wgrad_buffer", "wgrad fp8=True", "reduce_grad"]


def test_fp8_wgrad_applies_with_fp8_gathers_only():
    # ETPConfig.fp8_wgrad reads "with FP8 gathers, FP8 weight gradients too": a bf16 gather keeps them bf16.
    log = []
    ctx, gy = _ctx(log, fp8_wgrad=True, gather_dtype="param")
    _ETPWeightFunction.backward(ctx, gy)
    assert log == ["acquire", "wgrad_buffer", "wgrad fp8=False", "reduce_grad", "dgrad"]


def test_the_forward_rows_amax_reaches_a_saved_input_that_came_back_as_a_new_tensor():
    # A rebuilt or recomputed saved input is a new tensor without the forward's attachment
    # ([Note: rebuilt activations]): backward attaches the amax kept on ctx, so the FP8 weight
    # gradient makes its per-expert scales from it instead of reading the input again.
    log, seen = [], []
    amax = torch.ones(4)
    ctx, gy = _ctx(log, fp8_wgrad=True, x_row_amax=amax, seen=seen)
    _ETPWeightFunction.backward(ctx, gy)
    assert seen == [amax] and seen[0] is amax
