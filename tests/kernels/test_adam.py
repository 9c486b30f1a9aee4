"""etp.kernels.adam: the fused multi-tensor AdamW against its pure-torch reference (bit for bit:
the same float32 operations in the same order), and the reference against a float64 AdamW
and torch's own ``AdamW`` over several steps. Triton runs in the interpreter on CPU and
compiled on a GPU."""
import pytest
import torch

from etp.kernels import adam as adam_mod
from etp.kernels.adam import AdamWScalars, adamw_reference, multi_tensor_adamw

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
# Sizes: a partial chunk, one exact chunk (BLOCK * ITERS), several chunks plus a tail, empty.
SIZES = [(5, 7), (adam_mod._BLOCK * adam_mod._ITERS,), (3, 4100), (0,), (1,)]


def _state(seed, sizes=SIZES):
    gen = torch.Generator().manual_seed(seed)
    make = lambda: [torch.randn(*s, generator=gen).to(DEVICE) for s in sizes]  # noqa: E731
    params, grads, m = make(), make(), make()
    v = [t.abs() * 1e-3 for t in make()]
    return params, grads, [t * 1e-2 for t in m], v


def _clone(lists):
    return [[t.clone() for t in seq] for seq in lists]


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("step", [1, 5])
def test_kernel_matches_reference_bit_for_bit(scaled, step):
    params, grads, m, v = _state(step)
    scale = torch.tensor([2.5], device=DEVICE) if scaled else None
    want = _clone([params, m, v])
    want_out = [torch.empty(p.shape, dtype=torch.bfloat16, device=DEVICE) for p in params]
    adamw_reference(*want[:1], grads, *want[1:], AdamWScalars(**HYPER, step=step), scale, want_out)
    got_out = [torch.empty(p.shape, dtype=torch.bfloat16, device=DEVICE) for p in params]
    grads_before = _clone([grads])[0]
    multi_tensor_adamw(params, grads, m, v, **HYPER, step=step, grad_scale=scale, out=got_out, impl="triton")
    for got, ref in zip([*params, *m, *v, *got_out], [*want[0], *want[1], *want[2], *want_out]):
        assert torch.equal(got, ref)
    for g, before in zip(grads, grads_before):
        assert torch.equal(g, before)  # only read: torch's fused kernel writes the unscaled gradient back
    for p, o in zip(params, got_out):
        assert torch.equal(o, p.to(torch.bfloat16))  # what megatron's fp32 -> bf16 copy would write


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("scaled", [False, True])
def test_bf16_gradients_step_as_their_fp32_values(impl, scaled):
    """A bf16 gradient is read in place: the step equals the step from the fp32 tensor holding
    the same values (megatron's fp32 gradient buffer after one bf16 backward), bit for bit."""
    params, grads, m, v = _state(7)
    grads16 = [g.bfloat16() for g in grads]
    scale = torch.tensor([3.0], device=DEVICE) if scaled else None  # not a power of two: a real divide
    want = _clone([params, m, v])
    want_out = [torch.empty(p.shape, dtype=torch.bfloat16, device=DEVICE) for p in params]
    adamw_reference(*want[:1], [g.float() for g in grads16], *want[1:], AdamWScalars(**HYPER, step=4), scale,
                    want_out)
    got_out = [torch.empty(p.shape, dtype=torch.bfloat16, device=DEVICE) for p in params]
    multi_tensor_adamw(params, grads16, m, v, **HYPER, step=4, grad_scale=scale, out=got_out, impl=impl)
    for got, ref in zip([*params, *m, *v, *got_out], [*want[0], *want[1], *want[2], *want_out]):
        assert torch.equal(got, ref)


def _adamw_float64(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay):
    """AdamW written out in float64 (Loshchilov & Hutter, torch's parameterization)."""
    p = p * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat, v_hat = m / (1 - beta1 ** step), v / (1 - beta2 ** step)
    return p - lr * m_hat / (v_hat.sqrt() + eps), m, v


def test_reference_tracks_float64_and_torch_adamw_over_steps():
    params, _, _, _ = _state(11, sizes=[(64, 33), (17,)])
    ours = [p.clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    exact = [(p.double(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64))
             for p in params]
    theirs = [torch.nn.Parameter(p.clone()) for p in params]
    torch_adam = torch.optim.AdamW(theirs, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                                   weight_decay=HYPER["weight_decay"], foreach=False)
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 8):
        grads = [torch.randn(p.shape, generator=gen).to(DEVICE) for p in params]
        multi_tensor_adamw(ours, grads, m, v, **HYPER, step=step)
        exact = [_adamw_float64(e[0], g.double(), e[1], e[2], step, **HYPER) for e, g in zip(exact, grads)]
        for t, g in zip(theirs, grads):
            t.grad = g.clone()
        torch_adam.step()
    for p, e, t in zip(ours, exact, theirs):
        assert torch.allclose(p.double(), e[0], rtol=0, atol=1e-6)
        assert torch.allclose(p, t.detach(), rtol=0, atol=1e-6)


def test_gradient_scale_divides_every_gradient():
    params, grads, m, v = _state(2)
    want = _clone([params, m, v])
    multi_tensor_adamw(*want[:1], [g / 4.0 for g in grads], *want[1:], **HYPER, step=3, impl="torch")
    multi_tensor_adamw(params, grads, m, v, **HYPER, step=3, grad_scale=torch.tensor([4.0], device=DEVICE))
    for got, ref in zip([*params, *m, *v], [*want[0], *want[1], *want[2]]):
        assert torch.equal(got, ref)  # dividing by a power of two is exact


def test_bad_inputs_name_the_tensor_and_the_fix():
    p = [torch.zeros(4, device=DEVICE)]
    with pytest.raises(ValueError, match="grads has 2 tensors"):
        multi_tensor_adamw(p, p * 2, p, p, **HYPER, step=1)
    with pytest.raises(ValueError, match="grad 0 is torch.float16"):
        multi_tensor_adamw(p, [p[0].half()], p, p, **HYPER, step=1)
    with pytest.raises(ValueError, match="one dtype per call"):
        multi_tensor_adamw(p * 2, [p[0], p[0].bfloat16()], p * 2, p * 2, **HYPER, step=1)
    with pytest.raises(ValueError, match="out 0 is torch.float32"):
        multi_tensor_adamw(p, p, p, p, **HYPER, step=1, out=[p[0].clone()])
    with pytest.raises(ValueError, match="step=0"):
        multi_tensor_adamw(p, p, p, p, **HYPER, step=0)
