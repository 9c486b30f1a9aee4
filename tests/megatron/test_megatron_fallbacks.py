"""etp.megatron.fast_fallbacks: the foreach replacements for megatron-core's apex-free
helpers against float64 references, their installation, and fused Adam's switch
([Note: megatron fallbacks])."""
import pytest
import torch

from etp.installed import have_fused_kernels
from etp.megatron import fast_fallbacks, patches


def _tensors(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g).to(dtype) for shape in ((7, 5), (3,), (0,), (64, 33))]


def test_l2_norm_matches_float64_reference():
    tensors = _tensors()
    norm, per_tensor = fast_fallbacks.foreach_l2_norm(2048, None, [tensors], False)
    reference = torch.cat([t.double().flatten() for t in tensors]).norm()
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm.double()[0], reference, rtol=1e-6, atol=0)


def test_scale_in_place_cast_and_copy():
    src = _tensors()
    expected = [t * 0.25 for t in src]
    fast_fallbacks.foreach_scale(2048, None, [src, src], 0.25)  # clipping: grads scaled in place
    assert all(torch.equal(a, b) for a, b in zip(src, expected))
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
    fast_fallbacks.foreach_scale(2048, None, [src, dst], 1.0)  # megatron's fp32 -> bf16 param copy
    assert all(torch.equal(d, s.to(torch.bfloat16)) for s, d in zip(src, dst))
    fast_fallbacks.foreach_scale(2048, None, [src, dst], 3.0)
    assert all(torch.equal(d, (s * 3.0).to(torch.bfloat16)) for s, d in zip(src, dst))
    with pytest.raises(ValueError, match="2 sources but 1 destinations"):
        fast_fallbacks.foreach_scale(2048, None, [src[:2], dst[:1]], 1.0)


def test_install_rebinds_megatron_helpers():
    pytest.importorskip("megatron.core")
    if have_fused_kernels():
        pytest.skip("apex / TransformerEngine present: megatron uses their kernels")
    from megatron.core.optimizer import clip_grads, optimizer

    patches.use_fast_fallbacks(True)
    assert clip_grads.l2_norm_impl is fast_fallbacks.foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is fast_fallbacks.foreach_scale
    assert optimizer.multi_tensor_scale_impl is fast_fallbacks.foreach_scale
    assert patches.use_fast_fallbacks(True) is False  # idempotent
    patches.use_fast_fallbacks(False)
    assert clip_grads.l2_norm_impl is not fast_fallbacks.foreach_l2_norm
    assert optimizer.multi_tensor_scale_impl is not fast_fallbacks.foreach_scale
    assert patches.use_fast_fallbacks(True) is True


class _Wrapper:  # megatron's mixed-precision optimizer holds torch's as .optimizer
    def __init__(self, inner):
        self.optimizer = inner


def test_fuse_adam_leaves_cpu_params_alone():
    adam = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    assert fast_fallbacks.fuse_adam(_Wrapper(adam)) == 0
    assert not adam.param_groups[0].get("fused")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fused Adam needs CUDA")
def test_fused_adam_steps_like_foreach():
    torch.manual_seed(0)
    start = [torch.randn(257, 129, device="cuda") for _ in range(3)]
    grads = [torch.randn_like(p) for p in start]
    results = []
    for fuse in (False, True):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        adam = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        if fuse:
            assert fast_fallbacks.fuse_adam(_Wrapper(adam)) == 1
        for _ in range(3):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            adam.step()
        results.append(params)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fuse_adam_finds_every_link_of_a_chain():
    class Chained:  # megatron's ChainedOptimizer: .optimizer raises with several links
        def __init__(self, links):
            self.chained_optimizers = links

        @property
        def optimizer(self):
            raise AssertionError("ChainedOptimizer has more than one optimizer")

    adams = [torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]) for _ in range(2)]
    found = fast_fallbacks._torch_adams(Chained([_Wrapper(a) for a in adams]))
    assert sorted(map(id, found)) == sorted(map(id, adams))


@pytest.mark.parametrize("fused", [False, True])
def test_a_checkpoint_load_creates_adam_steps_where_torch_would(fused):
    """Loading into a fresh optimizer creates its Adam state; fused Adam (what fuse_adam
    switches megatron's to) needs the step on the param's device, foreach Adam on the host.
    The meta device stands for a GPU here."""
    from etp.megatron.checkpoint.optimizer_state import _param_states

    param = torch.nn.Parameter(torch.zeros(3, 2, device="meta"))
    adam = torch.optim.AdamW([param])
    adam.param_groups[0]["fused"] = fused
    _param_states(adam)
    assert adam.state[param]["step"].device.type == ("meta" if fused else "cpu")


def test_an_unsupported_megatron_core_is_refused_in_one_line():
    for version in ("0.16.1", "0.16.2rc1", "0.17.1", "0.19.2", "0.19.3rc0"):
        assert patches.check_megatron_core(version) == version
    for version in ("0.16.0", "0.15.3", "0.20.0", "0.20.0rc0", "1.0.0"):
        with pytest.raises(ImportError, match=r"supports megatron-core >=0\.16\.1,<0\.20, found") as err:
            patches.check_megatron_core(version)
        assert "\n" not in str(err.value)
