"""etp.megatron.fused_adamw ([Note: etp AdamW step]): etp's fused AdamW in place of torch's inside
a megatron-core mixed-precision optimizer link, against torch's own AdamW over several steps:
the fp32 masters, the bf16 model weights (written by the step, megatron's copy skipped once),
and the state torch's AdamW would hold. The real megatron-core optimizer runs it in the GPU
training tests."""
import pytest
import torch

from etp.megatron import fused_adamw, patches

SHAPES = [(6, 5), (7,), (0,)]
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class _Float16Link:
    """The slice of megatron-core's Float16OptimizerWithFloat16Params the install touches."""

    def __init__(self, models):
        self.float16_groups = [models]
        self.fp32_from_float16_groups = [[m.detach().float().requires_grad_() for m in models]]
        self.optimizer = torch.optim.AdamW(self.fp32_from_float16_groups[0], **HYPER)
        self.copies = 0

    def _copy_main_params_to_model_params(self):
        self.copies += 1
        for model, main in zip(self.float16_groups[0], self.fp32_from_float16_groups[0]):
            model.data.copy_(main.data)

    def step(self):  # megatron's step_with_ready_grads: the inner step, then the copy
        self.optimizer.step()
        self._copy_main_params_to_model_params()


def _models(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16()) for s in SHAPES]


def test_install_steps_like_torch_adamw_and_writes_the_bf16_weights():
    ours, theirs = _Float16Link(_models(0)), _Float16Link(_models(0))
    assert patches.step_with_fused_adamw(ours) == 1
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        for link in (ours, theirs):
            for main, grad in zip(link.fp32_from_float16_groups[0], grads):
                main.grad = grad.clone()
            link.step()
    assert ours.copies == 0 and theirs.copies == 4  # the fused step wrote the bf16 weights itself
    for mine, ref, model in zip(ours.fp32_from_float16_groups[0], theirs.fp32_from_float16_groups[0],
                                ours.float16_groups[0]):
        torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-7)  # an ulp: torch rounds its own way
        assert torch.equal(model.data, mine.detach().bfloat16())
        state, want = ours.optimizer.state[mine], theirs.optimizer.state[ref]
        assert set(state) == set(want) and state["step"].device.type == "cpu" and float(state["step"]) == 4.0
        torch.testing.assert_close(state["exp_avg_sq"], want["exp_avg_sq"], rtol=1e-6, atol=0)
    # Any other caller (a checkpoint load) still copies.
    ours._copy_main_params_to_model_params()
    assert ours.copies == 1


def test_a_gpu_side_step_count_moves_to_the_host_and_counts_on():
    link = _Float16Link(_models(2))
    main = link.fp32_from_float16_groups[0][0]
    link.optimizer.state[main].update(step=torch.tensor(6.0).to(main.device), exp_avg=torch.zeros_like(main),
                                      exp_avg_sq=torch.zeros_like(main))
    patches.step_with_fused_adamw(link)
    for m in link.fp32_from_float16_groups[0]:
        m.grad = torch.ones_like(m)
    link.step()
    assert float(link.optimizer.state[main]["step"]) == 7.0


@pytest.mark.parametrize("opt,reason", [
    (lambda p: torch.optim.AdamW(p, amsgrad=True), "amsgrad"),
    (lambda p: torch.optim.Adam(p, weight_decay=0.1), "L2 (coupled) weight decay"),
    (lambda p: torch.optim.SGD(p, lr=0.1), "not torch's Adam"),
])
def test_what_it_leaves_to_torch_says_why(opt, reason, caplog):
    link = _Float16Link(_models(3))
    link.optimizer = opt(link.fp32_from_float16_groups[0])
    assert reason in fused_adamw.unsupported_reason(link.optimizer)
    assert patches.step_with_fused_adamw(link) == 0
    assert reason in caplog.text


class _BufferedLink(_Float16Link):
    """Also what megatron's gradient side reads: each model param's ``main_grad`` (DDP's buffer),
    an fp32 link (the router's weights), the statistics group, the norm's list."""

    def __init__(self, models, fp32_models, grad_dtype):
        super().__init__(models)
        self.fp32_from_fp32_groups = [fp32_models]
        self.optimizer.add_param_group({"params": fp32_models})
        for m in [*models, *fp32_models]:
            m.main_grad = torch.zeros(m.shape, dtype=grad_dtype if m.dtype == torch.bfloat16 else torch.float32)

    def get_parameters(self):
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def get_main_grads_for_grad_norm(self):  # megatron's filter at one rank: shared params left out
        return [p.grad for p in self.get_parameters() if p.grad is not None and not getattr(p, "shared", False)]

    def get_grad_stats_parallel_group(self):
        return type("OneRank", (), {"size": lambda self: 1})()

    def step(self):  # megatron's prepare_grads, then step_with_ready_grads
        self._copy_model_grads_to_main_grads()
        super().step()


def test_bf16_gradients_read_in_place_step_as_megatrons_fp32_copies():
    """[Note: bf16 gradients, read in place]: megatron's own ``_copy_model_grads_to_main_grads``
    (fp32 copies of bf16 buffers) against the in-place read: the same masters, moments, bf16 weights
    and norm list, and no fp32 gradient made."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    def link():
        fp32 = [torch.nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(9)))]
        made = _BufferedLink(_models(4), fp32, torch.bfloat16)
        made.fp32_from_float16_groups[0][1].shared = True  # megatron copies it from the model param
        made._copy_model_grads_to_main_grads = Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads.__get__(
            made)
        assert patches.step_with_fused_adamw(made) == 1
        return made

    ours, theirs = link(), link()
    assert patches.read_bf16_grads_in_place(ours) == 1
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        grads = [torch.randn(m.shape, generator=g) for m in [*ours.float16_groups[0], *ours.fp32_from_fp32_groups[0]]]
        for each in (ours, theirs):
            for m, grad in zip([*each.float16_groups[0], *each.fp32_from_fp32_groups[0]], grads):
                m.main_grad.copy_(grad)  # bf16 or fp32, as DDP's buffer holds it
            each.step()
        assert all(main.grad is None for main in ours.fp32_from_float16_groups[0])  # no fp32 copy
        norm_ours, norm_theirs = fused_adamw.grads_for_norm(ours), theirs.get_main_grads_for_grad_norm()
        assert fused_adamw.grads_for_norm(theirs) is None
        assert [t.dtype for t in norm_ours] == [torch.bfloat16, torch.bfloat16, torch.float32]  # one left out
        assert all(torch.equal(a.float(), b) for a, b in zip(norm_ours, norm_theirs, strict=True))
    for a, b in zip(ours.get_parameters(), theirs.get_parameters()):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.optimizer.state[a][key], theirs.optimizer.state[b][key])
    for a, b in zip(ours.float16_groups[0], theirs.float16_groups[0]):
        assert torch.equal(a, b)


def test_fp32_buffers_keep_megatrons_copy():
    made = _BufferedLink(_models(6), [], torch.float32)
    copies = []
    made._copy_model_grads_to_main_grads = lambda: copies.append(1)
    patches.step_with_fused_adamw(made)
    patches.read_bf16_grads_in_place(made)
    made._copy_model_grads_to_main_grads()
    assert copies == [1] and made._etp_grads is None
