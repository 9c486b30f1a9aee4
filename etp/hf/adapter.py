"""What one Hugging Face architecture is to etp: its ``config.json`` as recipe model keys (and
back), and its tensors as pieces of the megatron-core ``GPTModel`` tensors etp's layer spec
builds. ``MoEAdapter`` holds what the Llama-family MoE models share; each architecture is one
file beside it (``qwen3_moe.py``, ``olmoe.py``, ``mixtral.py``) naming what differs. See
[Note: Hugging Face checkpoints] in ``etp/hf/__init__.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["ARCHITECTURE_KEYS", "ConversionError", "HFConfig", "MoEAdapter", "Piece", "check_recipe"]


class ConversionError(ValueError):
    """A checkpoint directory, ``config.json`` or recipe that etp-convert cannot convert: the
    message is one line naming what is wrong and the fix."""


#: recipe model keys that decide the tensors or the forward: a checkpoint and a recipe must agree on each
ARCHITECTURE_KEYS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "vocab_size",
    "swiglu", "normalization", "norm_epsilon", "qk_layernorm", "qk_layernorm_width", "position_embedding_type",
    "rotary_base", "untie_embeddings_and_output_weights", "add_bias_linear", "num_experts", "moe_router_topk",
    "moe_ffn_hidden_size", "moe_router_pre_softmax", "moe_router_score_function", "moe_layer_freq",
    "moe_shared_expert_intermediate_size", "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias",
    "moe_router_num_groups", "moe_router_group_topk", "ffn_hidden_size",
)


@dataclass(frozen=True)
class Piece:
    """Rows of one Hugging Face tensor that fill one box of one megatron-core tensor.

    Attributes:
        megatron: the tensor's state-dict name in etp's ``GPTModel`` (e.g.
            ``decoder.layers.0.self_attention.linear_qkv.weight``).
        rows: ``(start, stop)`` along the megatron tensor's first axis after ``index``.
        hf: the Hugging Face tensor's name; None for rows that hold zeros (the vocabulary's
            padding rows, which a Hugging Face checkpoint does not have).
        hf_rows: ``(start, stop)`` of the Hugging Face tensor's rows.
        index: leading indices of the megatron tensor before its row axis (an expert's).

    Both tensors' remaining axes are equal, so a piece is a contiguous element range of each.

    Example::

        Piece("decoder.layers.0.mlp.experts.experts.fc1_weight", (0, 768),
              "model.layers.0.mlp.experts.5.gate_proj.weight", (0, 768), index=(5,))
    """

    megatron: str
    rows: tuple[int, int]
    hf: str | None
    hf_rows: tuple[int, int] = (0, 0)
    index: tuple[int, ...] = ()

    def megatron_span(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """``(first, stop)``: the elements of the megatron tensor of ``shape`` (row-major) it fills."""
        lead = len(self.index)
        row = math.prod(shape[lead + 1:])
        first = sum(i * math.prod(shape[d + 1:]) for d, i in enumerate(self.index)) + self.rows[0] * row
        return first, first + (self.rows[1] - self.rows[0]) * row

    def row_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The axes after the row axis, shared by both tensors."""
        return tuple(shape[len(self.index) + 1:])


class HFConfig:
    """A ``config.json`` read for conversion: values by name, one-line errors for missing or
    unsupported ones, the RoPE base and dtype in either transformers' 4.x or 5.x spelling.

    Example::

        cfg = HFConfig(json.loads(Path("config.json").read_text()), "config.json")
        cfg.require("hidden_size"), cfg.rope_theta()
    """

    def __init__(self, values: dict, where: str) -> None:
        self.values, self.where = values, where

    def get(self, key: str, default: Any = None) -> Any:
        value = self.values.get(key, default)
        return default if value is None else value

    def require(self, key: str) -> Any:
        if self.values.get(key) is None:
            raise ConversionError(f"{self.where} has no {key}: a {self.model_type} config.json names it")
        return self.values[key]

    @property
    def model_type(self) -> str:
        return str(self.values.get("model_type"))

    def refuse(self, key: str, value: Any, why: str) -> None:
        raise ConversionError(f"{self.where}: {key}={value!r}: {why}")

    def expect(self, key: str, allowed: tuple, why: str) -> None:
        """Refuses ``key`` unless it is absent or one of ``allowed``."""
        value = self.values.get(key)
        if value is not None and value not in allowed:
            self.refuse(key, value, why)

    def rope_theta(self) -> float:
        """The RoPE base: ``rope_theta`` (transformers 4) or ``rope_parameters.rope_theta`` (5);
        any RoPE scaling other than the default is refused (etp builds plain RoPE)."""
        parameters = self.values.get("rope_parameters") or {}
        scaling = self.values.get("rope_scaling") or {}
        for source in (parameters, scaling):
            kind = source.get("rope_type", source.get("type", "default"))
            if kind not in ("default", None):
                self.refuse("rope_type", kind, "etp builds plain RoPE (megatron-core's rope): convert a checkpoint "
                            "without RoPE scaling")
        theta = self.values.get("rope_theta", parameters.get("rope_theta"))
        return float(theta if theta is not None else 10000.0)

    def dtype(self) -> str | None:
        return self.values.get("dtype") or self.values.get("torch_dtype")


def _vocab_divisor(vocab: int) -> int:
    """The largest power of two up to 128 dividing ``vocab``: megatron-core's padded vocabulary
    is then the checkpoint's own at TP 1 (no padding rows in the logits)."""
    divisor = 128
    while vocab % divisor:
        divisor //= 2
    return divisor


def check_recipe(expected: dict, model, recipe_name: str, checkpoint_name: str) -> None:
    """Raises one ``ConversionError`` naming every architecture key on which ``model`` (a
    recipe's ``ModelSpec``) and ``expected`` (a checkpoint's, from its adapter) disagree.

    Example::

        check_recipe(adapter.recipe_model_keys(cfg), recipe.model, "R.yaml", "config.json")
    """
    from etp.recipe import ModelSpec

    try:
        reference = ModelSpec(**{k: v for k, v in expected.items() if k in ModelSpec.__dataclass_fields__})
    except ValueError as error:
        raise ConversionError(f"{checkpoint_name} describes a model etp's recipes refuse: {error}") from None
    found = []
    for key in ARCHITECTURE_KEYS:
        want, got = getattr(reference, key), getattr(model, key)
        if key == "moe_layer_freq":
            want, got = reference.moe_layers, model.moe_layers
        elif key == "ffn_hidden_size" and all(reference.moe_layers) and reference.is_moe:
            continue  # no dense MLP: its width builds nothing
        elif key == "qk_layernorm_width" and not reference.qk_layernorm:
            continue
        elif isinstance(want, float) and isinstance(got, float) and math.isclose(want, got, rel_tol=1e-9):
            continue
        if want != got:
            show = (lambda v: "".join("1" if x else "0" for x in v)) if key == "moe_layer_freq" else repr
            found.append(f"{key} {show(want)} in {checkpoint_name}, {show(got)} in {recipe_name}")
    if found:
        raise ConversionError(f"{checkpoint_name} and {recipe_name} disagree on {len(found)} key(s): "
                              f"{'; '.join(found)}: fix the recipe (or --set KEY=VALUE), or write one with "
                              "etp-convert recipe-from-hf")


class MoEAdapter:
    """The Llama-family MoE decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU experts, a
    linear router): what Qwen3-MoE, OLMoE and Mixtral share. A subclass names its
    ``model_type`` and ``architecture``, reads its own ``config.json`` keys
    (``recipe_model_keys``, ``config_values``) and overrides the tensor names that differ.

    Example::

        adapter = Qwen3MoeAdapter()
        pieces = adapter.pieces(recipe.model, recipe.padded_vocab_size)
    """

    model_type = ""
    architecture = ""

    # ------------------------------------------------------------------ Hugging Face names
    def layer(self, i: int) -> str:
        return f"model.layers.{i}."

    def router(self, i: int) -> str:
        return self.layer(i) + "mlp.gate.weight"

    def expert(self, i: int, e: int) -> tuple[str, str, str]:
        """(gate, up, down) of expert ``e`` in layer ``i``."""
        base = self.layer(i) + f"mlp.experts.{e}."
        return base + "gate_proj.weight", base + "up_proj.weight", base + "down_proj.weight"

    def dense_mlp(self, i: int) -> tuple[str, str, str]:
        base = self.layer(i) + "mlp."
        return base + "gate_proj.weight", base + "up_proj.weight", base + "down_proj.weight"

    # ------------------------------------------------------------------ config.json
    def recipe_model_keys(self, cfg: HFConfig) -> dict:
        """The recipe model keys of a ``config.json`` (every key that builds the model, plus the
        training keys the checkpoint implies: dropout, init, auxiliary-loss weight). Raises
        ``ConversionError`` for what etp does not build."""
        raise NotImplementedError

    def config_values(self, m) -> dict:
        """The architecture's own ``config.json`` keys for the recipe's ``ModelSpec`` ``m``."""
        raise NotImplementedError

    def common_keys(self, cfg: HFConfig, experts: int, expert_ffn: int) -> dict:
        """The recipe keys every Llama-family MoE config.json gives the same way; refuses
        activations, biases and attention variants etp does not build."""
        cfg.expect("hidden_act", ("silu",), "etp's experts are SwiGLU (silu): convert a silu model")
        for key in ("attention_bias", "mlp_bias"):
            cfg.expect(key, (False,), "etp's linears have no biases (add_bias_linear: false)")
        heads, hidden = cfg.require("num_attention_heads"), cfg.require("hidden_size")
        vocab = cfg.require("vocab_size")
        positions = cfg.get("max_position_embeddings", 4096)
        return dict(
            num_layers=cfg.require("num_hidden_layers"), hidden_size=hidden, num_attention_heads=heads,
            num_query_groups=cfg.get("num_key_value_heads", heads), kv_channels=cfg.get("head_dim", hidden // heads),
            vocab_size=vocab, make_vocab_size_divisible_by=_vocab_divisor(vocab), seq_length=min(4096, positions),
            max_position_embeddings=positions, swiglu=True, normalization="RMSNorm",
            norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)), position_embedding_type="rope",
            rotary_base=cfg.rope_theta(), untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
            add_bias_linear=False, init_method_std=float(cfg.get("initializer_range", 0.02)),
            attention_dropout=float(cfg.get("attention_dropout", 0.0)), hidden_dropout=0.0,
            num_experts=experts, moe_router_topk=cfg.require("num_experts_per_tok"), moe_ffn_hidden_size=expert_ffn,
            moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0)), moe_router_load_balancing_type="aux_loss",
            moe_grouped_gemm=True,
        )

    def config_json(self, m, base: dict | None, dtype: str) -> dict:
        """``config.json`` of the recipe's model ``m``: ``base`` (the imported checkpoint's own,
        when the etp checkpoint carries it: token ids and other keys etp does not model) with
        every architecture key set from the recipe."""
        out = {k: v for k, v in (base or {}).items() if k not in ("rope_parameters", "rope_scaling", "dtype")}
        out.update(architectures=[self.architecture], model_type=self.model_type, vocab_size=m.vocab_size,
                   hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                   num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_query_groups,
                   head_dim=m.kv_channels, hidden_act="silu", rms_norm_eps=m.norm_epsilon, rope_theta=m.rotary_base,
                   tie_word_embeddings=not m.untie_embeddings_and_output_weights, num_experts_per_tok=m.moe_router_topk,
                   max_position_embeddings=m.max_position_embeddings, attention_bias=False,
                   attention_dropout=m.attention_dropout, initializer_range=m.init_method_std,
                   router_aux_loss_coef=m.moe_aux_loss_coeff, torch_dtype=dtype)
        out.update(self.config_values(m))
        return out

    # ------------------------------------------------------------------ tensors
    def pieces(self, m, padded_vocab: int) -> list[Piece]:
        """Every piece of the model of ``m`` (a recipe's ``ModelSpec``) whose vocabulary is
        padded to ``padded_vocab`` rows: together they fill each megatron-core tensor and read
        each Hugging Face tensor exactly once."""
        out = self._vocabulary("embedding.word_embeddings.weight", "model.embed_tokens.weight", m, padded_vocab)
        if m.untie_embeddings_and_output_weights:
            out += self._vocabulary("output_layer.weight", "lm_head.weight", m, padded_vocab)
        out.append(_whole("decoder.final_layernorm.weight", "model.norm.weight", m.hidden_size))
        for i, moe in enumerate(m.moe_layers):
            out += self._attention(m, i)
            out += self._experts(m, i) if moe else self._dense(m, i)
        return out

    def _vocabulary(self, megatron: str, hf: str, m, padded: int) -> list[Piece]:
        pieces = [Piece(megatron, (0, m.vocab_size), hf, (0, m.vocab_size))]
        if padded > m.vocab_size:  # megatron-core's padding rows: zeros in, dropped out
            pieces.append(Piece(megatron, (m.vocab_size, padded), None))
        return pieces

    def _attention(self, m, i: int) -> list[Piece]:
        hf, mg = self.layer(i), f"decoder.layers.{i}."
        kv, groups = m.kv_channels, m.num_query_groups
        per_group = m.num_attention_heads // groups
        qkv = mg + "self_attention.linear_qkv.weight"
        out = [_whole(mg + "input_layernorm.weight", hf + "input_layernorm.weight", m.hidden_size),
               _whole(mg + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight", m.hidden_size),
               _whole(mg + "self_attention.linear_proj.weight", hf + "self_attn.o_proj.weight", m.hidden_size)]
        for g in range(groups):
            # megatron-core interleaves per query group: q heads of group g, its k head, its v head
            # (SelfAttention.get_query_key_value_tensors).
            base = g * (per_group + 2) * kv
            out += [Piece(qkv, (base, base + per_group * kv), hf + "self_attn.q_proj.weight",
                          (g * per_group * kv, (g + 1) * per_group * kv)),
                    Piece(qkv, (base + per_group * kv, base + (per_group + 1) * kv), hf + "self_attn.k_proj.weight",
                          (g * kv, (g + 1) * kv)),
                    Piece(qkv, (base + (per_group + 1) * kv, base + (per_group + 2) * kv), hf + "self_attn.v_proj.weight",
                          (g * kv, (g + 1) * kv))]
        widths = m.qk_layernorm_widths
        if widths is not None:
            out += [_whole(mg + "self_attention.q_layernorm.weight", hf + "self_attn.q_norm.weight", widths[0]),
                    _whole(mg + "self_attention.k_layernorm.weight", hf + "self_attn.k_norm.weight", widths[1])]
        return out

    def _experts(self, m, i: int) -> list[Piece]:
        mg, ffn = f"decoder.layers.{i}.mlp.", m.moe_ffn_hidden_size
        out = [_whole(mg + "router.weight", self.router(i), m.num_experts)]
        for e in range(m.num_experts):
            gate, up, down = self.expert(i, e)
            # etp.modules.GroupedSwiGLUExperts: fc1 [E, 2 ffn, hidden], gate rows first; fc2 [E, hidden, ffn]
            out += [Piece(mg + "experts.experts.fc1_weight", (0, ffn), gate, (0, ffn), (e,)),
                    Piece(mg + "experts.experts.fc1_weight", (ffn, 2 * ffn), up, (0, ffn), (e,)),
                    Piece(mg + "experts.experts.fc2_weight", (0, m.hidden_size), down, (0, m.hidden_size), (e,))]
        return out

    def _dense(self, m, i: int) -> list[Piece]:
        mg, ffn = f"decoder.layers.{i}.mlp.", m.ffn_hidden_size
        gate, up, down = self.dense_mlp(i)
        return [Piece(mg + "linear_fc1.weight", (0, ffn), gate, (0, ffn)),
                Piece(mg + "linear_fc1.weight", (ffn, 2 * ffn), up, (0, ffn)),
                _whole(mg + "linear_fc2.weight", down, m.hidden_size)]


def _whole(megatron: str, hf: str, rows: int) -> Piece:
    return Piece(megatron, (0, rows), hf, (0, rows))
