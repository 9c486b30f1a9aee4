"""etp.rebuilt_activations.rebuilt_in_backward and the experts' rebuilt SwiGLU output ([Note: rebuilt
activations])."""
import gc
import weakref

import pytest
import torch

import etp.modules
from etp.gemm import grouped_linear_reference, plain_grouped_linear
from etp.rebuilt_activations import rebuilt_in_backward


def test_a_rebuilt_tensor_gives_the_same_gradients_and_is_not_kept():
    a = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    h = torch.relu(a)
    calls = []

    def rebuild():
        calls.append(1)
        return torch.relu(a)

    with rebuilt_in_backward(h, rebuild, [a], "relu(a)"):
        y = h.mm(w.t())
    kept = weakref.ref(h)
    del h
    gc.collect()
    assert kept() is None  # autograd holds the recipe, not the tensor
    y.sum().backward()
    assert calls == [1]
    # Independent reference: the gradient of sum(relu(a) w^T) in closed form.
    assert torch.allclose(w.grad, torch.relu(a).sum(0, keepdim=True).expand(4, 5).detach())
    assert torch.allclose(a.grad, (a > 0) * w.sum(0, keepdim=True).detach())


def test_nested_rebuilds_both_apply():
    # etp-train nests them: the experts' SwiGLU output inside the dispatcher's re-gathered
    # input. Neither tensor may be kept (only the GEMMs save them: scaling saves nothing); the
    # gradients match the closed form.
    a = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    u = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    calls = []
    x = a * 2.0
    with rebuilt_in_backward(x, lambda: calls.append("x") or a * 2.0, [a], "2 a"):
        y = x.mm(w.t())
        h = y * 3.0
        with rebuilt_in_backward(h, lambda: calls.append("h") or y * 3.0, [y], "3 y"):
            z = h.mm(v.t()) + x.mm(u.t())  # x saved inside the inner context: the outer's
    kept = [weakref.ref(x), weakref.ref(h)]
    del x, h
    gc.collect()
    assert [r() for r in kept] == [None, None]
    z.sum().backward()
    assert sorted(calls) == ["h", "x", "x"]
    g_y = 3.0 * v.detach().sum(0, keepdim=True).expand(6, 4)
    assert torch.allclose(w.grad, g_y.t().mm(2.0 * a.detach()))
    assert torch.allclose(a.grad, 2.0 * (g_y.mm(w.detach()) + u.detach().sum(0, keepdim=True)))
    assert torch.allclose(u.grad, (2.0 * a.detach()).sum(0, keepdim=True).expand(3, 5))


def test_an_outer_saved_tensor_policy_keeps_its_say():
    # Under torch's non-reentrant checkpoint the checkpoint decides what is kept; a rebuild
    # would hold its inputs alive behind it. The rebuild steps aside, the gradients stay right.
    from torch.utils.checkpoint import checkpoint

    a = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    calls = []

    def block(a):
        h = torch.relu(a)
        with rebuilt_in_backward(h, lambda: calls.append(1) or torch.relu(a), [a], "relu(a)"):
            return h.mm(w.t())

    checkpoint(block, a, use_reentrant=False).sum().backward()
    assert calls == []
    assert torch.allclose(a.grad, (a > 0) * w.sum(0, keepdim=True).detach())


def test_a_rebuilt_tensor_refuses_an_input_modified_in_place():
    a = torch.randn(6, 5)
    w = torch.randn(4, 5, requires_grad=True)
    h = torch.relu(a)
    with rebuilt_in_backward(h, lambda: torch.relu(a), [a], "relu(a)"):
        y = h.mm(w.t())
    a.add_(1.0)
    with pytest.raises(RuntimeError, match=r"relu\(a\): an input .* modified in place"):
        y.sum().backward()


@pytest.mark.parametrize("rebuilt", [True, False])
def test_the_experts_swiglu_output_is_rebuilt_with_the_same_bits(monkeypatch, rebuilt):
    # etp's grouped GEMM Function saves its input whole: tests/parity.py swaps in a loop of
    # torch.mm for the whole session once imported, which saves per-expert views instead.
    monkeypatch.setattr(etp.modules, "plain_grouped_linear", plain_grouped_linear)
    experts = etp.modules.GroupedSwiGLUExperts(4, 8, 6, dtype=torch.float64)
    x = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    counts = torch.tensor([3, 0, 5, 2])
    probs = torch.rand(10, dtype=torch.float64, requires_grad=True)
    outputs = []
    real_swiglu = etp.modules.expert_swiglu

    def recording_swiglu(*args, **kwargs):
        out = real_swiglu(*args, **kwargs)
        outputs.append(weakref.ref(out))
        return out

    monkeypatch.setattr(etp.modules, "expert_swiglu", recording_swiglu)
    if not rebuilt:
        monkeypatch.setattr(etp.modules, "rebuilt_in_backward", lambda *a, **k: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    y = experts(x, counts, probs)
    gc.collect()
    assert (outputs[0]() is None) == rebuilt
    gy = torch.randn_like(y)
    y.backward(gy)
    # Independent reference: the unsharded experts in float64 through autograd, SwiGLU in torch.
    w1 = experts.fc1_weight.detach().clone().requires_grad_()
    w2 = experts.fc2_weight.detach().clone().requires_grad_()
    xr, pr = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    gu = grouped_linear_reference(xr, w1, counts)
    g, u = gu.chunk(2, dim=1)
    ref = grouped_linear_reference(torch.nn.functional.silu(g) * u * pr[:, None], w2, counts)
    ref.backward(gy)
    assert torch.allclose(y, ref)
    for got, want in ((x.grad, xr.grad), (probs.grad, pr.grad), (experts.fc1_weight.grad, w1.grad),
                      (experts.fc2_weight.grad, w2.grad)):
        assert torch.allclose(got, want)
