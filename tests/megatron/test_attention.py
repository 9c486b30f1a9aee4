"""SDPAttention (etp.megatron.attention) against megatron-core's stock DotProductAttention on
CPU, forward and backward, float64 and float32: causal (no mask passed, as GPTModel does),
an explicit boolean mask, grouped-query attention; plus an explicit float64
softmax(Q K^T) V reference and the state-dict keys of a GPTModel built with either backend.

DotProductAttention itself is CPU-capable math, but three helpers it calls allocate on
``cuda`` (the global score buffer, the default causal mask, the CUDA RNG tracker's fork):
the ``megatron_on_cpu`` fixture swaps those three for CPU equivalents; the attention math
is megatron's own code.
"""
import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")


@pytest.fixture
def megatron_on_cpu(monkeypatch):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.fusions import fused_softmax

    buffer = SimpleNamespace(get_tensor=lambda shape, dtype, name, *a, **k: torch.empty(shape, dtype=dtype))
    monkeypatch.setattr(parallel_state, "get_global_memory_buffer", lambda: buffer)
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker",
                        lambda: SimpleNamespace(fork=contextlib.nullcontext))
    monkeypatch.setattr(fused_softmax, "get_default_causal_mask",
                        lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool())


def _config(heads=8, groups=8, dtype=torch.float64, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=heads * 16, num_attention_heads=heads, num_query_groups=groups,
                attention_dropout=0.0, use_cpu_initialization=True, params_dtype=dtype)
    return TransformerConfig(**{**base, **kw})


def _cores(config):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from etp.megatron.attention import SDPAttention

    tp = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    args = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                pg_collection=tp)
    return DotProductAttention(**args), SDPAttention(**args)


def _qkv(s, b, heads, groups, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, heads, d, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(s, b, groups, d, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(s, b, groups, d, generator=gen, dtype=dtype, requires_grad=True)
    return q, k, v


def _run(core, q, k, v, mask):
    out = core(q, k, v, mask)
    grad = torch.randn_like(out, generator=torch.Generator().manual_seed(7))
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


TOLERANCES = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=2e-5, atol=2e-5)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("groups", [8, 2])
@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_matches_megatron_dot_product_attention(megatron_on_cpu, dtype, groups, masked):
    s, b, heads, d = 37, 3, 8, 16  # odd sequence length on purpose
    local, sdpa = _cores(_config(heads, groups, dtype))
    mask = None
    if masked:  # causal plus the last 5 keys of sample 1 padded out (True = masked, megatron's convention)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).expand(b, 1, s, s).clone()
        mask[1, :, :, -5:] = True
        mask[1, :, -5:, :] = False  # keep every row with at least one visible key...
        mask[1, :, -5:, :] |= torch.triu(torch.ones(5, s, dtype=torch.bool), diagonal=s - 4)  # ...causally
    q, k, v = _qkv(s, b, heads, groups, d, dtype)
    want = _run(local, q, k, v, mask)
    got = _run(sdpa, q, k, v, mask)
    assert got[0].shape == (s, b, heads * d)
    for name, a, e in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, e, **TOLERANCES[dtype], msg=name)


def test_sdpa_matches_float64_reference():
    """softmax(scale Q K^T + causal) V per head, written out, with GQA key sharing."""
    from etp.megatron.attention import sdpa_core_attention

    s, b, heads, groups, d = 11, 2, 4, 2, 8
    q, k, v = _qkv(s, b, heads, groups, d, torch.float64, seed=3)
    got = sdpa_core_attention(q, k, v, None, causal=True, scale=1 / math.sqrt(d))
    rep = heads // groups
    kk, vv = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, kk) / math.sqrt(d)
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
    want = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), vv).reshape(s, b, heads * d)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_sdpa_rejects_unsupported_settings():
    from megatron.core.transformer.enums import AttnMaskType

    from etp.megatron.attention import SDPAttention

    with pytest.raises(ValueError, match="softmax_type"):
        SDPAttention(_config(softmax_type="off-by-one"), 1, AttnMaskType.causal, "self")
    _, core = _cores(_config())
    assert isinstance(core, SDPAttention) and not list(core.parameters()) and not list(core.buffers())
    q, k, v = _qkv(4, 1, 8, 8, 16, torch.float64)
    with pytest.raises(ValueError, match="packed"):
        core(q, k, v, None, packed_seq_params=object())


def test_layer_spec_picks_the_backend():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from etp.megatron.attention import SDPAttention
    from etp.megatron.model import etp_gpt_layer_spec

    def core(backend):
        spec = etp_gpt_layer_spec(num_experts=4, attention_backend=backend).submodules.self_attention
        core = spec.submodules.core_attention
        return getattr(core, "module", core)  # megatron's local spec names the class itself

    assert core("sdpa") is SDPAttention and core("local") is DotProductAttention
    with pytest.raises(ValueError, match="attention_backend"):
        etp_gpt_layer_spec(num_experts=4, attention_backend="flash")


def _state_keys(ctx):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from etp.megatron.model import etp_gpt_layer_spec

    ps.initialize_model_parallel()
    try:
        config = _config(heads=4, groups=4, dtype=torch.float32, num_moe_experts=4, moe_ffn_hidden_size=32,
                         gated_linear_unit=True, add_bias_linear=False, activation_func=F.silu,
                         moe_token_dispatcher_type="allgather")
        keys = {}
        for backend in ("local", "sdpa"):
            model = GPTModel(config=config, transformer_layer_spec=etp_gpt_layer_spec(4, attention_backend=backend),
                             vocab_size=128, max_sequence_length=32)
            keys[backend] = sorted(model.state_dict().keys())
        return keys
    finally:
        ps.destroy_model_parallel()


def test_state_dict_keys_do_not_depend_on_the_backend():
    from harness import run_distributed

    keys = run_distributed(_state_keys, 1)[0]
    assert keys["sdpa"] == keys["local"] and keys["sdpa"]


def _gpt_losses(ctx):
    """A dense megatron-core GPTModel (GQA, RMSNorm) built with each backend from the same
    seed: loss and embedding gradient of one batch. Exercises the spec and the call contract of
    megatron's SelfAttention (mask, mask type, packed-sequence and bias keywords)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from etp.megatron.model import etp_gpt_layer_spec

    ps.initialize_model_parallel()
    try:
        config = _config(heads=4, groups=2, dtype=torch.float64, num_layers=2, ffn_hidden_size=128,
                         gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                         hidden_dropout=0.0, normalization="RMSNorm")
        tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
        positions = torch.arange(32).expand(2, 32)
        out = {}
        for backend in ("local", "sdpa"):
            torch.manual_seed(0)
            spec = etp_gpt_layer_spec(None, attention_backend=backend, normalization="RMSNorm")
            model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=32,
                             position_embedding_type="learned_absolute")  # megatron's rope needs CUDA
            loss = model(tokens, positions, None, labels=tokens).mean()
            loss.backward()
            out[backend] = (loss.detach(), model.embedding.word_embeddings.weight.grad.clone())
        return out
    finally:
        ps.destroy_model_parallel()


def test_gpt_model_trains_the_same_with_either_backend():
    from harness import run_distributed

    out = run_distributed(_shimmed_gpt_losses, 1)[0]
    torch.testing.assert_close(out["sdpa"][0], out["local"][0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out["sdpa"][1], out["local"][1], rtol=1e-9, atol=1e-12)


def _shimmed_gpt_losses(ctx):
    """_gpt_losses with the megatron_on_cpu shims, applied inside the spawned rank."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.fusions import fused_softmax

    buffer = SimpleNamespace(get_tensor=lambda shape, dtype, name, *a, **k: torch.empty(shape, dtype=dtype))
    parallel_state.get_global_memory_buffer = lambda: buffer
    tensor_parallel.get_cuda_rng_tracker = lambda: SimpleNamespace(fork=contextlib.nullcontext)
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()
    return _gpt_losses(ctx)
