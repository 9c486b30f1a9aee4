"""Derived quantities of a recipe: the world-size checks, data-parallel sizes, global batch,
microbatches, padded vocabulary and parameter counts."""
from __future__ import annotations

from etp.installed import have_fused_kernels
from etp.recipe.validation import RecipeError, check_parallel_layout


class RecipeQuantities:
    """Sizes derived from a recipe's sections (mixed into :class:`Recipe`)."""

    # ------------------------------------------------------------------ world size
    def _world(self, world_size: int | None) -> int:
        world = self.parallel.world_size if world_size is None else world_size
        if world is None:
            raise RecipeError(
                "world_size", None, "world_size is not set in the recipe: pass the number of ranks"
            )
        return world

    def check_world_size(self, world_size: int) -> None:
        """Checks the sizes that depend on the number of ranks: TP x PP x CP divides it, ETP
        fits inside data parallelism (dense and expert), and the global batch is a whole
        number of microbatches over data-parallel ranks. Raises :class:`RecipeError`.

        Example::

            Recipe.from_yaml("recipes/tiny_moe_cpu.yaml").check_world_size(2)
        """
        p, e, t = self.parallel, self.etp, self.train
        if p.world_size is not None and world_size != p.world_size:
            raise RecipeError(
                "world_size",
                p.world_size,
                f"recipe key world_size={p.world_size} but {world_size!r} ranks were started: "
                f"launch {p.world_size} ranks or override world_size",
            )
        dp, _ = check_parallel_layout(
            world_size,
            tensor_model_parallel_size=p.tensor_model_parallel_size,
            pipeline_model_parallel_size=p.pipeline_model_parallel_size,
            context_parallel_size=p.context_parallel_size,
            expert_model_parallel_size=p.expert_model_parallel_size,
            expert_tensor_parallel_size=p.expert_tensor_parallel_size,
            etp_size=e.etp_size,
            expert_etp_size=e.expert_etp_size,
        )
        per_step = t.micro_batch_size * dp
        if t.global_batch_size is not None and t.global_batch_size % per_step:
            below = t.global_batch_size // per_step * per_step
            nearest = [n for n in (below, below + per_step) if n > 0]
            raise RecipeError(
                "global_batch_size",
                t.global_batch_size,
                f"recipe key global_batch_size={t.global_batch_size} is not divisible by "
                f"micro_batch_size x data_parallel_size = {t.micro_batch_size} x {dp} = "
                f"{per_step} (world_size {world_size}): the nearest valid values are "
                f"{' or '.join(map(str, nearest))} (--set global_batch_size=N)",
            )

    def data_parallel_size(self, world_size: int | None = None) -> int:
        """Megatron's DP = world / (TP x PP x CP); ETP ranks are part of it."""
        world = self._world(world_size)
        self.check_world_size(world)
        return world // self.parallel.model_parallel_size

    def expert_data_parallel_size(self, world_size: int | None = None) -> int:
        """Megatron's expert DP = world / (ETP_tp x EP x PP); expert ETP ranks are part of it."""
        world = self._world(world_size)
        self.check_world_size(world)
        return world // self.parallel.expert_model_parallel_span

    def replicate_size(self, world_size: int | None = None) -> int:
        """Dense replicas DDP reduces over: DP / etp_size."""
        return self.data_parallel_size(world_size) // self.etp.etp_size

    def expert_replicate_size(self, world_size: int | None = None) -> int:
        """Expert replicas DDP reduces over: expert DP / expert_etp_size."""
        return self.expert_data_parallel_size(world_size) // self.etp.expert_etp_size

    def global_batch_size(self, world_size: int | None = None) -> int:
        """Samples per optimizer step (``global_batch_size``, or one microbatch per DP rank)."""
        dp = self.data_parallel_size(world_size)
        if self.train.global_batch_size is not None:
            return self.train.global_batch_size
        return self.train.micro_batch_size * dp

    def samples_per_rank(self, world_size: int | None = None) -> int:
        """Each data-parallel rank's share of the global batch per optimizer step."""
        return self.global_batch_size(world_size) // self.data_parallel_size(world_size)

    def num_microbatches(self, world_size: int | None = None) -> int:
        """Microbatches per rank per optimizer step (gradient accumulation steps)."""
        return self.samples_per_rank(world_size) // self.train.micro_batch_size

    def main_grad_bytes(self, world_size: int | None = None) -> int:
        """Bytes per element of megatron-core DDP's gradient buffer on GPUs: 2 (the 16-bit
        parameter dtype) with ``grad_reduce_in_bf16``, and where nothing is reduced or
        accumulated and etp's AdamW reads the bf16 gradients in place: one rank, one micro-batch,
        ``bf16``, ``megatron_fallbacks: fast``, megatron-core's DDP without its distributed
        optimizer, no apex / TransformerEngine. There the fp32 buffer would hold the same values
        ([Note: bf16 gradients, read in place] in ``etp.megatron.fused_adamw``). Else 4 (fp32).

        Example::

            Recipe.from_yaml("recipes/moe_flagship.yaml").main_grad_bytes(8)   # 4
        """
        p, t = self.parallel, self.train
        if not (t.bf16 or t.fp16):
            return 4  # fp32 parameters: DDP keeps their gradients fp32
        if p.grad_reduce_in_bf16:
            return 2
        alone = self._world(world_size) == 1 and self.num_microbatches(world_size) == 1
        plain_ddp = not (p.use_distributed_optimizer or p.use_torch_fsdp2 or p.use_megatron_fsdp)
        if not (alone and plain_ddp and t.bf16 and t.megatron_fallbacks == "fast"):
            return 4
        # With apex or TransformerEngine megatron steps their Adam, not etp's: it would copy bf16
        # gradients to fp32.
        return 4 if have_fused_kernels() else 2

    # ------------------------------------------------------------------ sizes
    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding: vocab_size rounded up to make_vocab_size_divisible_by x TP
        (Megatron-LM's rule)."""
        m, p = self.model, self.parallel
        multiple = m.make_vocab_size_divisible_by * p.tensor_model_parallel_size
        return -(-self.model.vocab_size // multiple) * multiple

    def num_params(self, active: bool = False) -> int:
        """Parameters of the unsharded GPT model megatron-core builds from this recipe: its
        dense and MoE layers (``moe_layer_freq``), shared experts and QK norms included.
        ``active=True`` counts ``moe_router_topk`` routed experts per MoE layer instead of all.

        Example::

            Recipe.from_yaml("recipes/moe_flagship.yaml").num_params() / 1e9   # ~4.70
        """
        m = self.model
        h, kv = m.hidden_size, m.kv_channels
        bias = m.add_bias_linear
        norm = 2 * h if m.normalization == "LayerNorm" else h
        gated = 2 if m.swiglu else 1
        qkv_out = (m.num_attention_heads + 2 * m.num_query_groups) * kv
        attention = h * qkv_out + m.num_attention_heads * kv * h
        if bias:
            attention += qkv_out + h
        if m.qk_layernorm:  # one norm for queries, one for keys: a head wide, or every head (full width)
            attention += (norm // h) * sum(m.qk_layernorm_widths)

        def mlp(ffn: int) -> int:
            n = h * gated * ffn + ffn * h
            return n + (gated * ffn + h if bias else 0)

        dense_layer = norm + attention + norm + mlp(m.ffn_hidden_size)
        moe_layer = 0
        if m.is_moe:
            experts = m.moe_router_topk if active else m.num_experts
            router = m.num_experts * h + (m.num_experts if bias else 0)
            moe_layer = norm + attention + norm + router + experts * mlp(m.moe_ffn_hidden_size)
            if m.moe_shared_expert_intermediate_size is not None:
                moe_layer += mlp(m.moe_shared_expert_intermediate_size) + (h if m.moe_shared_expert_gate else 0)
        layers = sum(moe_layer if moe else dense_layer for moe in m.moe_layers)
        embedding = self.padded_vocab_size * h
        if m.position_embedding_type == "learned_absolute":
            embedding += m.max_position_embeddings * h
        output = self.padded_vocab_size * h if m.untie_embeddings_and_output_weights else 0
        return embedding + layers + norm + output
