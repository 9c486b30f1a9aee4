"""Model FLOPs of a training iteration (attention included) and MFU.

[Note: FLOP count]
Training FLOPs per token = 6 x GEMM weights per token + 12 x L x (heads x kv_channels) x s:

* GEMMs: forward 2 FLOPs per weight per token, backward 4 (data and weight gradients), for
  every weight a token multiplies by: attention projections, the router, the ``topk`` routed
  experts it visits (``Recipe.num_params(active=True)``), norms (negligible) and the output
  layer's logits GEMM (V x h). The input embedding is a lookup, not a GEMM: its V x h (and the
  learned position table) are *not* counted; with tied embeddings the logits GEMM is counted
  once, through the output layer.
* Attention scores: per layer and token, ``Q K^T`` and ``P V`` are 2 x s x (heads x
  kv_channels) multiply-adds each, 4 s a d FLOPs forward, 12 s a d forward + backward.
  Convention: the full s x s square is counted although the mask is causal (the PaLM /
  Megatron-LM MFU convention; the kernels skip about half of it). ``causal=True`` counts
  the half the causal kernels compute (``6 x L x heads x kv_channels x s``), reported beside.
  Softmax, norms and activations are not counted.

MFU = achieved model TFLOP/s per GPU / the GPU's *datasheet* dense bf16 peak (``PEAK_TFLOPS``:
989 for H100 SXM and H200 alike, the same tensor cores). A measured GEMM ceiling (about 800 on
H200 for a bf16 8192^3 GEMM) is not a peak: dividing by it would inflate MFU by a quarter and
make figures incomparable with anyone else's. ``achievable_fraction`` is the other ratio, labelled
as such where a report shows it beside MFU.

Example::

    recipe = Recipe.from_yaml("recipes/moe_flagship.yaml")
    flops = training_flops(recipe, tokens=8 * 2048)   # one iteration of 8 samples
    tflops = flops / step_seconds / 1e12
    mfu(tflops, peak_tflops("NVIDIA H200"))
"""
from __future__ import annotations

__all__ = ["PEAK_TFLOPS", "achievable_fraction", "attention_flops_per_token", "gemm_weights_per_token", "mfu",
           "peak_tflops", "training_flops"]

#: Datasheet bf16 dense peak TFLOP/s per GPU by a substring of ``torch.cuda.get_device_name()``,
#: first match wins. Never a measured figure (see [Note: FLOP count]).
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),   # datasheet, dense (the H100 SXM's tensor cores)
    ("H100", 989.0),   # datasheet, SXM dense
    ("H800", 989.0),   # datasheet
    ("A100", 312.0),   # datasheet
    ("B200", 2250.0),  # datasheet, dense
)


def gemm_weights_per_token(recipe) -> int:
    """Weights one token is multiplied by (see [Note: FLOP count]): the active parameters less
    the embedding lookup tables, plus the logits GEMM when the output layer is tied."""
    m = recipe.model
    table = recipe.padded_vocab_size * m.hidden_size
    lookups = table + (m.max_position_embeddings * m.hidden_size
                       if m.position_embedding_type == "learned_absolute" else 0)
    logits = 0 if m.untie_embeddings_and_output_weights else table
    return recipe.num_params(active=True) - lookups + logits


def attention_flops_per_token(recipe, causal: bool = False) -> int:
    """``12 x layers x heads x kv_channels x seq_length`` (forward + backward of ``Q K^T`` and
    ``P V``, the full square); half of it with ``causal=True``."""
    m = recipe.model
    full = 12 * m.num_layers * m.num_attention_heads * m.kv_channels * m.seq_length
    return full // 2 if causal else full


def training_flops(recipe, tokens: int, causal: bool = False) -> int:
    """Model FLOPs of forward + backward over ``tokens`` tokens (see [Note: FLOP count]).

    Args:
        recipe: an ``etp.megatron.Recipe``.
        tokens: tokens processed (per rank for per-rank TFLOP/s).
        causal: count the causal half of the attention square instead of all of it.
    """
    return tokens * (6 * gemm_weights_per_token(recipe) + attention_flops_per_token(recipe, causal))


def peak_tflops(device_name: str | None) -> float | None:
    """The bf16 dense peak of a GPU by name (``PEAK_TFLOPS``), None when unknown (CPU included)."""
    if not device_name:
        return None
    for key, value in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return value
    return None


def mfu(tflops: float, peak: float | None) -> float | None:
    """Model FLOPs utilization (0..1) against the datasheet peak, None without a peak.

    Example::

        mfu(356.0, peak_tflops("NVIDIA H100 80GB HBM3"))   # 0.36
    """
    if not peak:
        return None
    return tflops / peak


def achievable_fraction(tflops: float, gemm_ceiling_tflops: float | None) -> float | None:
    """Achieved TFLOP/s over a *measured* bf16 GEMM ceiling of the same GPU: how close a step
    comes to what its GEMMs can reach. Not MFU (which divides by the datasheet peak); a report
    that shows it labels it so. None without a ceiling.

    Example::

        achievable_fraction(356.0, 798.0)   # 0.45 of the measured 8192^3 bf16 GEMM
    """
    if not gemm_ceiling_tflops:
        return None
    return tflops / gemm_ceiling_tflops
