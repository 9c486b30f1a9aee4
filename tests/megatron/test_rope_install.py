"""etp.megatron.rope ([Note: RoPE in megatron-core]): the binding in megatron-core's attention
module, and ``fused_apply_rotary_pos_emb`` against megatron-core's ``apply_rotary_pos_emb``
(forward and gradient, bit for bit) on the calls it takes and the ones it hands back. The
fused kernel itself: tests/kernels/test_rope.py."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")
from megatron.core.models.common.embeddings import rope_utils  # noqa: E402
from megatron.core.transformer import attention  # noqa: E402

from etp.megatron import patches, rope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _config(**kw):
    return SimpleNamespace(**{"apply_rope_fusion": False, "rotary_interleaved": False, "multi_latent_attention": False,
                              **kw})


def _freqs(s, rot):
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    f = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    return torch.cat((f, f), dim=-1)[:, None, None, :].to(DEVICE)


@pytest.mark.parametrize("config,mscale", [(_config(), 1.0), (_config(), 0.75), (_config(rotary_interleaved=True), 1.0)],
                         ids=["covered", "covered-mscale", "interleaved-handed-back"])
def test_same_bits_as_megatron(config, mscale):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 2, 4, 16, generator=g).to(DEVICE, torch.bfloat16)
    freqs, grad = _freqs(6, 16), torch.randn(6, 2, 4, 16, generator=g).to(DEVICE, torch.bfloat16)
    ours, theirs = base.clone().requires_grad_(), base.clone().requires_grad_()
    got = rope.fused_apply_rotary_pos_emb(ours, freqs, config, mscale=mscale, cp_group=object())
    want = rope_utils.apply_rotary_pos_emb(theirs, freqs, config=config, mscale=mscale, cp_group=object())
    assert torch.equal(got, want)
    got.backward(grad)
    want.backward(grad)
    assert torch.equal(ours.grad, theirs.grad)


def test_tables_made_once_per_freqs_follow_its_changes():
    """The cos / sin tables kept on ``freqs`` serve the next call, and are made again once
    ``freqs`` changes in place: each call still matches megatron-core's bit for bit."""
    config, freqs = _config(), _freqs(6, 16)
    x = torch.randn(6, 2, 4, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    for scale in (1.0, 3.0):
        freqs.mul_(scale)  # 1.0: the tables of the first pass stay valid
        for _ in range(2):
            want = rope_utils.apply_rotary_pos_emb(x, freqs, config=config, cp_group=object())
            assert torch.equal(rope.fused_apply_rotary_pos_emb(x, freqs, config), want)


def test_install_binds_once_and_uninstall_restores():
    try:
        patches.use_fused_rope(False)
        assert attention.apply_rotary_pos_emb is rope_utils.apply_rotary_pos_emb
        assert patches.use_fused_rope(True) is True and patches.use_fused_rope(True) is False
        assert attention.apply_rotary_pos_emb is rope.fused_apply_rotary_pos_emb
    finally:
        patches.use_fused_rope(False)
    assert attention.apply_rotary_pos_emb is rope_utils.apply_rotary_pos_emb
