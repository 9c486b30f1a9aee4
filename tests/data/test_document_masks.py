"""Per-document attention, positions and loss, against independent references: the device-built
block mask is megatron-core's own dataset mask; SDPA attention under it equals a float64 attention
computed one document at a time; megatron-core's ``GPTModel`` and etp's CPU model on a packed
sequence with reset masks and positions give each document the logits it gets alone; the loss
mask changes the language-model loss as a float64 reference says."""
import math

import pytest
import torch
from harness import run_distributed

pytest.importorskip("megatron.core")
EOD = 0


def _rows(seed: int, b: int = 3, s: int = 24) -> torch.Tensor:
    """Token rows with end-of-document tokens first, last, twice in a row and in the middle."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 50, (b, s), generator=gen)
    tokens[0, [0, 5, 6, s - 1]] = EOD
    tokens[1, [11]] = EOD
    if b > 2:
        tokens[2, torch.randperm(s, generator=gen)[:4]] = EOD
    return tokens


def test_document_mask_is_megatron_cores_dataset_mask():
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    from etp.data.batch import document_attention_mask

    tokens = _rows(0)
    want = torch.stack([_get_ltor_masks_and_position_ids(row, EOD, True, True, True, True)[0] for row in tokens])
    assert torch.equal(document_attention_mask(tokens, EOD), want)
    plain = torch.stack([_get_ltor_masks_and_position_ids(row, EOD, False, False, False, True)[0] for row in tokens])
    assert torch.equal(document_attention_mask(torch.full_like(tokens, 7), EOD), plain)  # one document: causal


def _documents(row: torch.Tensor) -> list[slice]:
    """The documents of a token row: each ends at (and includes) an end-of-document token."""
    ends = [i + 1 for i in range(len(row)) if row[i] == EOD]
    starts = [0] + ends
    return [slice(a, b) for a, b in zip(starts, ends + [len(row)]) if b > a]


def _attention_per_document(q, k, v, tokens, scale):
    """float64 softmax attention computed for each document on its own, [s, b, heads * d]."""
    s, b, heads, d = q.shape
    out = torch.zeros(s, b, heads, d, dtype=torch.float64)
    group = heads // k.shape[2]
    for j in range(b):
        for doc in _documents(tokens[j]):
            for h in range(heads):
                qd, kd, vd = q[doc, j, h], k[doc, j, h // group], v[doc, j, h // group]
                scores = qd @ kd.T * scale
                n = scores.shape[0]
                scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
                out[doc, j, h] = scores.softmax(-1) @ vd
    return out.reshape(s, b, heads * d)


@pytest.mark.parametrize("form", ["bool-mask", "document-ids"])
@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
def test_sdpa_under_the_block_mask_is_attention_per_document(groups, form):
    """The dense mask and the document ids etp-train's batches carry (on CPU: SDPA under the
    mask they expand to; FlexAttention on GPUs, tests/megatron/test_document_attention.py)."""
    from etp.data.batch import document_attention_mask, document_ids
    from etp.megatron.attention import sdpa_core_attention

    tokens = _rows(1)
    s, b = tokens.shape[1], tokens.shape[0]
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(s, b, 4, 8, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(s, b, groups, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    mask = document_attention_mask(tokens, EOD) if form == "bool-mask" else document_ids(tokens, EOD)
    got = sdpa_core_attention(q, k, v, mask, causal=True, scale=0.3)
    want = _attention_per_document(q, k, v, tokens, 0.3)
    assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()
    causal = sdpa_core_attention(q, k, v, None, causal=True, scale=0.3)
    assert not torch.allclose(causal, want, atol=1e-3)  # the mask mattered


def _gpt_model():
    """A dense float64 megatron-core GPTModel with etp's SDPA attention and learned positions
    (megatron-core's rotary embedding needs CUDA)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from etp.megatron.model import etp_gpt_decoder_spec

    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               use_cpu_initialization=True, add_bias_linear=False, normalization="RMSNorm",
                               hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64)
    spec = etp_gpt_decoder_spec(config, normalization="RMSNorm", attention_backend="sdpa", grouped_experts=False)
    torch.manual_seed(0)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=32,
                    position_embedding_type="learned_absolute").double().eval()


def _tiny_model():
    """etp-train's own CPU model (megatron-core's GPTModel of the tiny recipe: rotary positions,
    MoE) in float64."""
    from data_cases import TINY

    from etp.recipe import Recipe
    from etp.train.model_build import build_model

    recipe = Recipe.from_yaml(TINY, vocab_size=64, etp={"etp_size": 1, "expert_etp_size": 1})
    model, _, _ = build_model(recipe, torch.device("cpu"))
    return model.double().eval()


def _packed_equals_separate(model, call) -> float:
    """Max |logits of a packed row (reset mask and positions) - logits of each document alone|."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    from etp.data.batch import document_ids

    tokens = _rows(3, b=2, s=20)
    positions = torch.stack([_get_ltor_masks_and_position_ids(r, EOD, True, True, True, False)[2] for r in tokens])
    # The document ids etp-train's batches carry: megatron-core hands them to core attention untouched.
    packed = call(model, tokens, document_ids(tokens, EOD), positions)
    worst = 0.0
    for j in range(tokens.shape[0]):
        for doc in _documents(tokens[j]):
            alone = call(model, tokens[j:j + 1, doc], None, None)[0]
            worst = max(worst, float((packed[j, doc] - alone).abs().max()))
    unmasked = call(model, tokens, None, None)
    assert not torch.allclose(unmasked, packed, atol=1e-3)  # documents did attend across without the mask
    return worst


def _models_on_ranks(ctx):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    with torch.no_grad():
        gpt = _packed_equals_separate(_gpt_model(), lambda m, t, mask, pos: m(
            t, torch.arange(t.shape[1]).expand_as(t) if pos is None else pos, mask))
        tiny = _packed_equals_separate(_tiny_model(), lambda m, t, mask, pos: m(
            t, torch.arange(t.shape[1]).expand_as(t) if pos is None else pos, mask))
    loss = _loss_mask_checks()
    ps.destroy_model_parallel()
    return gpt, tiny, loss


def _loss_mask_checks():
    """etp-train's loss of a batch with eod_mask_loss's mask against float64 from the same logits."""
    from data_cases import TINY

    from etp.data.batch import Batch
    from etp.recipe import Recipe
    from etp.train.model_build import build_model

    recipe = Recipe.from_yaml(TINY, vocab_size=64, etp={"etp_size": 1, "expert_etp_size": 1})
    model, loss_fn, _ = build_model(recipe, torch.device("cpu"))
    tokens = _rows(4, b=2, s=16)
    labels = torch.roll(tokens, -1, dims=1)
    mask = (tokens != EOD).float()
    with torch.no_grad():
        loss, _ = loss_fn(model, Batch(tokens=tokens, labels=labels, loss_mask=mask))
        plain, _ = loss_fn(model, Batch(tokens=tokens, labels=labels))
        logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None).double()
    per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                  reduction="none")
    want = (per_token * mask.reshape(-1).double()).sum() / mask.sum()
    assert abs(float(loss) - float(want)) < 1e-5 * float(want), (float(loss), float(want))
    assert abs(float(plain) - float(per_token.mean())) < 1e-5 * float(want)
    assert abs(float(loss) - float(plain)) > 1e-3  # the mask changed the loss, as the reference says
    from etp.megatron.cross_entropy import masked_token_mean

    assert float(masked_token_mean(per_token.view(2, 16), torch.zeros(2, 16))) == 0.0  # all masked: 0, not NaN
    return float(loss)


def test_packed_documents_get_the_logits_they_get_alone():
    """On 2 gloo ranks, in float64: megatron-core's GPTModel (learned positions) and the CPU model
    (rotary positions, MoE) with reset masks and positions; and the loss mask."""
    for gpt, tiny, _ in run_distributed(_models_on_ranks, 2):
        # megatron-core builds its rotary tables in float32, so the rope model is exact to ~1e-10,
        # not to float64's 1e-16; without the mask the logits differ by > 1e-3.
        assert gpt < 1e-12 and tiny < 1e-8, (gpt, tiny)
