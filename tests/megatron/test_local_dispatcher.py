"""etp.megatron.local_dispatcher: the sync-free EP-1 permutation against megatron-core's own
``permute`` (same rows, same order) and a float64 combine, gradients against autograd of the
float64 reference, and (GPU) a megatron MoELayer with it against megatron's alltoall
dispatcher ([Note: local dispatcher])."""
import pytest
import torch

pytest.importorskip("megatron.core")
from megatron.core.transformer.moe.moe_utils import permute  # noqa: E402

from etp.megatron.local_dispatcher import _Permute, _Unpermute, local_permutation  # noqa: E402


def _routing(tokens=37, experts=8, topk=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    idx = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, idx, True)
    probs = torch.where(routing_map, scores, torch.zeros(()))
    return routing_map, probs


@pytest.mark.parametrize("tokens,experts,topk", [(37, 8, 3), (1, 4, 1), (64, 64, 4), (5, 6, 6)])
def test_permutation_matches_megatron_permute(tokens, experts, topk):
    routing_map, probs = _routing(tokens, experts, topk)
    x = torch.randn(tokens, 16)
    reference, reference_probs, _ = permute(x, routing_map, probs=probs, num_out_tokens=tokens * topk)[:3]
    idx, order, token_rows, inverse = local_permutation(routing_map, topk)
    assert torch.equal(_Permute.apply(x, token_rows, inverse, topk), reference)
    assert torch.equal(probs.gather(1, idx).reshape(-1).index_select(0, order), reference_probs)
    # Each expert's rows are contiguous and counted by the map's column sums.
    experts_of_rows = idx.reshape(-1)[order]
    assert torch.equal(torch.bincount(experts_of_rows, minlength=experts), routing_map.sum(0))


def test_combine_and_gradients_match_float64_reference():
    routing_map, probs = _routing()
    tokens, topk = routing_map.shape[0], 3
    _, order, token_rows, inverse = local_permutation(routing_map, topk)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 16, generator=g).requires_grad_(True)
    w = torch.randn(tokens * topk, 1, generator=g)
    rows = _Permute.apply(x, token_rows, inverse, topk)
    out = _Unpermute.apply(rows * w, token_rows, inverse, topk)
    out.square().sum().backward()

    # float64 reference: token t's output is the sum over its K rows j of w[j] * x[t].
    x64 = x.detach().double().requires_grad_(True)
    token_of_row = torch.div(order, topk, rounding_mode="floor")
    expected = torch.zeros(tokens, 16, dtype=torch.float64).index_add(0, token_of_row, x64[token_of_row] * w.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    expected.square().sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)


def test_combine_of_bf16_rows_rounds_once():
    routing_map, _ = _routing()
    _, order, token_rows, inverse = local_permutation(routing_map, 3)
    rows = torch.randn(order.numel(), 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out = _Unpermute.apply(rows, token_rows, inverse, 3)
    exact = rows.double().index_select(0, inverse).view(-1, 3, 16).sum(1)
    assert out.dtype == torch.bfloat16 and torch.equal(out, exact.float().to(torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="megatron-core's MoE router needs CUDA")
def test_moe_layer_matches_megatron_alltoall():
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from etp.megatron.compat import spec_submodules
    from etp.megatron.local_dispatcher import LocalTokenDispatcher, install_local_dispatchers
    from etp.megatron.model import etp_gpt_layer_spec
    from etp.megatron.patches import use_te_free_router

    use_te_free_router()  # megatron-core 0.16 without TransformerEngine (its router's te_general_gemm)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    try:
        config = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, num_moe_experts=16,
                                   moe_router_topk=4, moe_ffn_hidden_size=128, moe_token_dispatcher_type="alltoall",
                                   gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                                   add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
                                   moe_aux_loss_coeff=0.0)
        submodules = spec_submodules(etp_gpt_layer_spec(num_experts=16).submodules.mlp)  # MoESubmodules
        outputs = []
        for local in (False, True):
            torch.manual_seed(0)
            layer = MoELayer(config, submodules).cuda()
            if local:
                assert install_local_dispatchers(layer) == 1
                assert isinstance(layer.token_dispatcher, LocalTokenDispatcher)
            x = torch.randn(128, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            out, _ = layer(x)
            out.float().square().sum().backward()
            outputs.append((out.detach(), x.grad, [p.grad.clone() for p in layer.parameters()]))
        (out_a, gx_a, gp_a), (out_b, gx_b, gp_b) = outputs
        # Same experts, same rows; the combine differs only in summation (bf16 scatter_add vs fp32 sum).
        torch.testing.assert_close(out_b, out_a, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(gx_b, gx_a, rtol=2e-2, atol=2e-2)
        for a, b in zip(gp_a, gp_b):
            torch.testing.assert_close(b, a, rtol=5e-2, atol=5e-2)
    finally:
        ps.destroy_model_parallel()


def test_counts_follow_the_sorted_rows_even_for_padding_tokens():
    from etp.megatron.local_dispatcher import LocalTokenDispatcher

    routing_map, probs = _routing(tokens=9, experts=5, topk=2)
    routing_map[4] = False  # a padding token: megatron's router leaves its row empty
    probs[4] = 0.0
    dispatcher = LocalTokenDispatcher.__new__(LocalTokenDispatcher)  # no process groups on CPU
    dispatcher.topk = 2
    x = torch.randn(9, 1, 4)
    rows, row_probs = dispatcher.dispatch_preprocess(x, routing_map, probs)
    _, counts, _ = dispatcher.dispatch_postprocess(rows, row_probs)
    assert counts.sum() == rows.shape[0] == 18
    # Each expert's rows are the counted block, in order; the padding token's rows weigh 0.
    idx, order, _, _ = local_permutation(routing_map, 2)
    assert torch.equal(torch.repeat_interleave(torch.arange(5), counts), idx.reshape(-1)[order])
    assert row_probs[torch.div(order, 2, rounding_mode="floor") == 4].abs().sum() == 0
    out = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(rows)))
    assert out.shape == x.shape and torch.allclose(out[:, 0], 2 * x[:, 0])  # K copies of each token


def test_replace_token_dispatchers_swaps_every_moe_layer():
    """The install helpers' shared loop (``install_local_dispatchers`` and, for the recipe key
    ``moe_token_dispatcher_type: etp``, ``install_etp_dispatchers``): every MoELayer, however
    deep, gets the new dispatcher built from the old one's experts, its config and its groups;
    other modules are left alone. CPU: layers made without megatron's (CUDA) router."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.moe_layer import MoELayer

    from etp.megatron.local_dispatcher import replace_token_dispatchers

    def fake_layer(tag):
        layer = MoELayer.__new__(MoELayer)
        torch.nn.Module.__init__(layer)
        layer.config = f"config {tag}"
        layer.token_dispatcher = SimpleNamespace(ep_group=f"ep {tag}", tp_group=f"tp {tag}", tp_ep_group=f"tp_ep {tag}",
                                                 num_local_experts=2, local_expert_indices=[2, 3])
        return layer

    layers = [fake_layer(0), fake_layer(1)]
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(layers[0]), layers[1])
    made = []

    def make(old, config, groups):
        made.append((old.local_expert_indices, config, groups.ep, groups.expt_tp, groups.tp_ep))
        return f"new {len(made)}"

    assert replace_token_dispatchers(model, make) == 2
    assert made == [([2, 3], f"config {i}", f"ep {i}", f"tp {i}", f"tp_ep {i}") for i in (0, 1)]
    assert [layer.token_dispatcher for layer in layers] == ["new 1", "new 2"]


def _saved_by_the_graph(out):
    """Every tensor the custom autograd Functions behind ``out`` keep, as backward unpacks it."""
    seen, stack, saved = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        saved += [t for t in getattr(node, "saved_tensors", ()) if isinstance(t, torch.Tensor)]
        stack += [n for n, _ in node.next_functions]
    return saved


@pytest.mark.parametrize("marked", [False, True])
def test_experts_keep_the_layer_input_not_its_permuted_copies(marked, monkeypatch):
    """With the dispatcher's mark the experts' first GEMM keeps the unpermuted tokens and the row
    indices, not the K copies (backward unpacks a fresh gather, not the permuted tensor's
    storage), and backward gathers the same rows again: output and every gradient equal bit for
    bit to the unmarked run."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    import etp.gemm
    import etp.modules
    from etp.megatron.local_dispatcher import mark_permuted
    from etp.megatron.model import ETPGroupedExperts

    # etp's grouped GEMM Function (tests/parity.py swaps in a per-expert torch.mm loop for the
    # whole session once it is imported; that loop's autograd keeps views of the input).
    monkeypatch.setattr(etp.modules, "plain_grouped_linear", etp.gemm.plain_grouped_linear)

    def run(mark):
        torch.manual_seed(0)
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_moe_experts=4,
                                   moe_router_topk=2, moe_ffn_hidden_size=16, gated_linear_unit=True,
                                   activation_func=torch.nn.functional.silu, add_bias_linear=False,
                                   use_cpu_initialization=True)
        experts = ETPGroupedExperts(4, config)
        routing_map, probs = _routing(tokens=9, experts=4, topk=2, seed=5)
        x = torch.randn(9, 32, requires_grad=True)
        idx, order, rows, inverse = local_permutation(routing_map, 2)
        permuted = _Permute.apply(x, rows, inverse, 2)
        if mark:
            mark_permuted(permuted, x, rows)
        counts = torch.bincount(idx.reshape(-1), minlength=4)
        permuted_probs = probs.gather(1, idx).reshape(-1).index_select(0, order)
        out, _ = experts(permuted, counts, permuted_probs)
        kept = any(t.data_ptr() == permuted.data_ptr() for t in _saved_by_the_graph(out))
        out.square().sum().backward()
        return kept, out.detach(), x.grad, [p.grad for p in experts.parameters()]

    kept, out, grad_x, grads = run(marked)
    assert kept is not marked
    _, out_ref, grad_x_ref, grads_ref = run(False)
    assert torch.equal(out, out_ref) and torch.equal(grad_x, grad_x_ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ref))


def test_regathered_rows_refuses_a_source_modified_after_the_forward():
    from etp.megatron.local_dispatcher import mark_permuted, regathered_rows

    x = torch.randn(5, 4)
    rows = torch.tensor([0, 2, 2, 4])
    permuted = mark_permuted(x.index_select(0, rows), x, rows)
    w = torch.randn(3, 4, requires_grad=True)
    with regathered_rows(permuted):
        y = permuted.mm(w.t())
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        y.sum().backward()
