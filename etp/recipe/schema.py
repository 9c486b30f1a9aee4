"""The recipe key schema: every flat key with its type, range and default, grouped in the model,
parallel and train sections (Megatron-LM argument names)."""
from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass, field
from typing import Any

import torch

from etp.config import ETPConfig
from etp.recipe.architecture import check_architecture, moe_layer_pattern
from etp.recipe.data_keys import DEFAULT_SPLIT, check_data_keys, parse_blend, parse_split
from etp.recipe.validation import (
    _BOOL,
    _FLOAT,
    _INT,
    _LAYER_FREQ,
    _STR,
    _STR_LIST,
    RecipeError,
    _fail,
    _validate_fields,
    check_schedule,
)


def _key(
    default: Any,
    kind: str,
    help: str,
    *,
    required: bool = False,
    minimum: float | None = None,
    exclusive_minimum: bool = False,
    below: float | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A recipe key: a dataclass field whose metadata drives validation.

    ``default`` None means "derived" (or unset) unless ``required``; ``minimum`` / ``below``
    bound numbers (``below`` exclusive); ``choices`` restrict strings (and each element of a
    ``_STR_LIST``).
    """
    return field(
        default=default,
        metadata=dict(
            kind=kind,
            help=help,
            required=required,
            minimum=minimum,
            exclusive_minimum=exclusive_minimum,
            below=below,
            choices=choices,
        ),
    )


def _positive(default: Any, help: str, **kw: Any) -> Any:
    return _key(default, _INT, help, minimum=1, **kw)


_NORMALIZATIONS = ("LayerNorm", "RMSNorm")
_QK_LAYERNORM_WIDTHS = ("head", "full")
_POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
_DISPATCHERS = ("allgather", "alltoall", "flex", "local", "etp")
_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
_SCORE_FUNCTIONS = ("softmax", "sigmoid")
_LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
_WEIGHT_DECAY_INCR_STYLES = ("constant", "linear", "cosine")
_BACKENDS = ("auto", "gloo", "nccl")
_ATTENTION_BACKENDS = ("sdpa", "local")  # etp.megatron.attention.ATTENTION_BACKENDS
# megatron-core 0.16 TransformerConfig: recompute_granularity, recompute_method and the
# recompute_modules its __post_init__ allows.
_RECOMPUTE_GRANULARITIES = ("full", "selective")
_RECOMPUTE_METHODS = ("uniform", "block")
_RECOMPUTE_MODULES = (
    "core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"
)
#: allowed by megatron-core but refused by etp: module -> why
_UNSUPPORTED_RECOMPUTE_MODULES = {
    "moe_act": "recomputes the activation inside megatron-core's grouped-GEMM experts "
    "(GroupedMLP / TEGroupedMLP), which etp's models do not use (megatron-core also refuses it "
    "without its own moe_grouped_gemm): use 'moe' to recompute the whole MoE layer",
    "mla_up_proj": "needs multi-latent attention, which etp's models do not have",
}
SYNTHETIC = "synthetic"
#: the longest ``distributed_timeout_minutes`` a ``datetime.timedelta`` holds
_LONGEST_TIMEOUT_MINUTES = datetime.timedelta.max // datetime.timedelta(minutes=1)



# ---------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class ModelSpec:
    """The GPT / MoE model of a recipe (Megatron-LM argument names; see the module docstring
    for defaults). Derived defaults (``ffn_hidden_size``, ``num_query_groups``,
    ``max_position_embeddings``, ``moe_ffn_hidden_size``) are filled in on construction.

    Example::

        spec = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64,
                         vocab_size=256, num_experts=4)
        spec.moe_ffn_hidden_size   # 256 (= ffn_hidden_size = 4 * 64)
    """

    num_layers: int = _positive(None, "transformer layers", required=True)
    hidden_size: int = _positive(None, "model width", required=True)
    ffn_hidden_size: int | None = _positive(None, "dense MLP width")
    num_attention_heads: int = _positive(None, "attention heads", required=True)
    num_query_groups: int | None = _positive(None, "key/value heads (grouped-query attention)")
    kv_channels: int | None = _positive(None, "width of one attention head (None: hidden_size / heads)")
    seq_length: int = _positive(None, "tokens per sample", required=True)
    max_position_embeddings: int | None = _positive(None, "positions of the position embedding")
    vocab_size: int = _positive(None, "token ids are < vocab_size", required=True)
    make_vocab_size_divisible_by: int = _positive(128, "pad the vocabulary to this x TP")
    swiglu: bool = _key(False, _BOOL, "SwiGLU MLPs")
    normalization: str = _key("LayerNorm", _STR, "norm layers", choices=_NORMALIZATIONS)
    qk_layernorm: bool = _key(False, _BOOL, "normalize each head's queries and keys (the normalization's kind)")
    qk_layernorm_width: str = _key(
        "head", _STR, "what qk_layernorm normalizes: head (each head's kv_channels: megatron-core's, Qwen3's) or "
        "full (the whole query and the whole key: OLMoE's)", choices=_QK_LAYERNORM_WIDTHS)
    norm_epsilon: float = _key(1e-5, _FLOAT, "epsilon of every LayerNorm / RMSNorm", minimum=0.0,
                               exclusive_minimum=True)
    position_embedding_type: str = _key(
        "learned_absolute", _STR, "position embedding", choices=_POSITION_EMBEDDINGS
    )
    rotary_base: float = _key(10000.0, _FLOAT, "RoPE base period (rope only)", minimum=0.0, exclusive_minimum=True)
    untie_embeddings_and_output_weights: bool = _key(False, _BOOL, "separate output layer weight")
    add_bias_linear: bool = _key(True, _BOOL, "biases in linear layers")
    init_method_std: float = _key(
        0.02, _FLOAT, "weight init std", minimum=0.0, exclusive_minimum=True
    )
    attention_dropout: float = _key(0.1, _FLOAT, "attention dropout", minimum=0.0, below=1.0)
    hidden_dropout: float = _key(0.1, _FLOAT, "hidden dropout", minimum=0.0, below=1.0)
    num_experts: int | None = _positive(None, "routed experts per MoE layer (None: dense)")
    moe_router_topk: int = _positive(2, "experts per token")
    moe_ffn_hidden_size: int | None = _positive(None, "width of each expert's MLP")
    moe_grouped_gemm: bool = _key(False, _BOOL, "grouped expert GEMMs")
    moe_token_dispatcher_type: str = _key(
        "allgather", _STR, "token dispatcher (local: etp's sync-free one for EP 1 and TP 1; etp: etp.ep's for EP >= 1, TP 1)", choices=_DISPATCHERS
    )
    moe_aux_loss_coeff: float = _key(0.0, _FLOAT, "load-balancing loss weight", minimum=0.0)
    moe_router_load_balancing_type: str = _key(
        "aux_loss", _STR, "router load balancing", choices=_LOAD_BALANCING
    )
    moe_layer_freq: int | tuple[int, ...] = _key(
        1, _LAYER_FREQ, "MoE layers: one every N layers, or a 0 (dense) / 1 (MoE) pattern per layer"
    )
    moe_shared_expert_intermediate_size: int | None = _positive(
        None, "width of the shared experts' MLP, every token (None: no shared experts)")
    moe_shared_expert_gate: bool = _key(False, _BOOL, "a sigmoid gate on the shared experts' output")
    moe_router_score_function: str = _key(
        "softmax", _STR, "router scores: softmax or sigmoid", choices=_SCORE_FUNCTIONS)
    moe_router_pre_softmax: bool = _key(False, _BOOL, "softmax over all experts before the top-k")
    moe_router_topk_scaling_factor: float | None = _key(
        None, _FLOAT, "multiplies the routing probabilities", minimum=0.0, exclusive_minimum=True)
    moe_router_enable_expert_bias: bool = _key(
        False, _BOOL, "aux-loss-free balancing: a per-expert bias on the top-k choice (sigmoid)")
    moe_router_bias_update_rate: float = _key(
        1e-3, _FLOAT, "expert-bias step per global batch", minimum=0.0, exclusive_minimum=True)
    moe_router_num_groups: int | None = _positive(None, "expert groups of group-limited routing")
    moe_router_group_topk: int | None = _positive(None, "groups each token may route to")
    moe_z_loss_coeff: float | None = _key(None, _FLOAT, "router z-loss weight", minimum=0.0)
    attention_backend: str = _key(
        "sdpa", _STR, "core attention: sdpa (torch fused kernels) or local (megatron's, full scores)",
        choices=_ATTENTION_BACKENDS,
    )

    def __post_init__(self) -> None:
        _validate_fields(self)
        if self.ffn_hidden_size is None:
            # Megatron-LM's validate_args rule.
            h = self.hidden_size
            ffn = int((4 * h * 2 / 3) / 64) * 64 if self.swiglu else 4 * h
            if ffn < 1:
                _fail(
                    "hidden_size",
                    h,
                    "is too small for the swiglu ffn_hidden_size default: set ffn_hidden_size",
                )
            object.__setattr__(self, "ffn_hidden_size", ffn)
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                _fail(
                    "hidden_size",
                    self.hidden_size,
                    f"must be divisible by num_attention_heads={self.num_attention_heads} "
                    "(the head width is hidden_size / num_attention_heads; or set kv_channels)",
                )
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_query_groups:
            _fail(
                "num_query_groups",
                self.num_query_groups,
                f"must divide num_attention_heads={self.num_attention_heads}",
            )
        if self.max_position_embeddings < self.seq_length:
            _fail(
                "max_position_embeddings",
                self.max_position_embeddings,
                f"must be >= seq_length={self.seq_length}",
            )
        if self.num_experts is None:
            if self.moe_ffn_hidden_size is not None:
                _fail(
                    "moe_ffn_hidden_size",
                    self.moe_ffn_hidden_size,
                    "is set but num_experts is not (a dense model has no experts)",
                )
        else:
            if self.moe_ffn_hidden_size is None:
                object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
            if self.moe_router_topk > self.num_experts:
                _fail(
                    "moe_router_topk",
                    self.moe_router_topk,
                    f"must be <= num_experts={self.num_experts}",
                )
        check_architecture(self)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def qk_layernorm_widths(self) -> tuple[int, int] | None:
        """(query, key) widths of the QK norms' weights: one head's ``kv_channels`` each, or
        with ``qk_layernorm_width: full`` every query head's and every key head's; None without
        ``qk_layernorm``."""
        if not self.qk_layernorm:
            return None
        if self.qk_layernorm_width == "full":
            return self.num_attention_heads * self.kv_channels, self.num_query_groups * self.kv_channels
        return self.kv_channels, self.kv_channels

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it is an MoE layer (``moe_layer_freq``; all False for a dense
        model)."""
        return moe_layer_pattern(self)


@dataclass(frozen=True)
class ParallelSpec:
    """Parallel sizes of a recipe (Megatron-LM names) and etp's driver keys ``world_size`` and
    ``backend``. ``expert_tensor_parallel_size`` defaults to the tensor size.

    Example::

        spec = ParallelSpec(tensor_model_parallel_size=2, sequence_parallel=True)
        spec.expert_tensor_parallel_size   # 2
    """

    tensor_model_parallel_size: int = _positive(1, "tensor-parallel size (TP)")
    pipeline_model_parallel_size: int = _positive(1, "pipeline-parallel size (PP; 1 only: no pipeline schedule runs)")
    expert_model_parallel_size: int = _positive(1, "expert-parallel size (EP)")
    expert_tensor_parallel_size: int | None = _positive(None, "tensor-parallel size of experts")
    context_parallel_size: int = _positive(1, "context-parallel size (CP; 1 only: no sequence split runs)")
    sequence_parallel: bool = _key(False, _BOOL, "sequence parallelism (needs TP > 1)")
    use_distributed_optimizer: bool = _key(False, _BOOL, "shard optimizer state over DP")
    overlap_grad_reduce: bool = _key(False, _BOOL, "overlap DDP gradient reduction with backward")
    overlap_param_gather: bool = _key(
        False, _BOOL, "distributed optimizer: all-gather the updated parameters during the next forward "
        "(megatron-core's recommendation for MoE; needs use_distributed_optimizer and overlap_grad_reduce)")
    use_torch_fsdp2: bool = _key(
        False, _BOOL, "torch FSDP2 (etp.train.baselines.fsdp2.FSDP2Step) instead of megatron-core DDP: the peer "
        "etp is benchmarked against; data parallelism only, ETP off")
    use_megatron_fsdp: bool = _key(
        False, _BOOL, "megatron-core's Megatron-FSDP (etp.train.baselines.megatron_fsdp.MegatronFSDPStep: "
        "optim_grads_params with megatron-core's distributed optimizer) instead of megatron-core DDP: the peer "
        "etp is benchmarked against; data parallelism only, ETP off, CUDA only")
    grad_reduce_in_bf16: bool = _key(
        False, _BOOL, "reduce DDP gradients in bf16 instead of fp32 (half the bytes; one rank with one micro-batch "
        "keeps them bf16 either way: nothing is reduced or accumulated, Recipe.main_grad_bytes)")
    ddp_bucket_size: int | None = _positive(None, "elements per DDP gradient bucket (None: megatron-core's default)")
    world_size: int | None = _positive(None, "ranks the recipe is meant for (etp driver key)")
    backend: str = _key("auto", _STR, "process-group backend (etp driver key)", choices=_BACKENDS)
    # Checked in __post_init__, with the fix in its message.
    distributed_timeout_minutes: float = _key(
        10.0, _FLOAT, "minutes a collective waits for a peer before the rank fails (every process group)")

    def __post_init__(self) -> None:
        _validate_fields(self)
        minutes = self.distributed_timeout_minutes
        if not minutes > 0:
            _fail("distributed_timeout_minutes", minutes, "must be > 0: the minutes a collective waits for a "
                  "stalled peer before the rank fails (Megatron-LM's default 10; fractions allowed, e.g. 0.5 for 30 s)")
        if minutes > _LONGEST_TIMEOUT_MINUTES:
            _fail("distributed_timeout_minutes", minutes, f"is longer than a timedelta holds: use at most "
                  f"{_LONGEST_TIMEOUT_MINUTES}")
        for key, what in (("pipeline_model_parallel_size", "runs no pipeline schedule (every rank would build "
                           "and run all layers)"),
                          ("context_parallel_size", "splits no sequence over context-parallel ranks (each "
                           "would run the whole sequence of the same samples)")):
            if getattr(self, key) > 1:
                _fail(key, getattr(self, key), f"is not supported by etp-train yet: it {what}: set {key}=1")
        if self.expert_tensor_parallel_size is None:
            object.__setattr__(self, "expert_tensor_parallel_size", self.tensor_model_parallel_size)
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            _fail(
                "sequence_parallel",
                True,
                "needs tensor_model_parallel_size > 1 (it splits the sequence over the TP group)",
            )
        if self.use_megatron_fsdp:
            self._check_megatron_fsdp()
        if self.use_torch_fsdp2:
            self._check_torch_fsdp2()
        if self.overlap_param_gather and not (self.use_distributed_optimizer and self.overlap_grad_reduce):
            _fail("overlap_param_gather", True, "needs use_distributed_optimizer: true and overlap_grad_reduce: "
                  "true (megatron-core overlaps the distributed optimizer's parameter all-gather)")

    def _check_torch_fsdp2(self) -> None:
        """What FSDP2 over the data-parallel group cannot combine with (the rest: ``Recipe``)."""
        for key in ("overlap_param_gather", "use_distributed_optimizer"):
            if getattr(self, key):
                _fail(key, True, f"must be false with use_torch_fsdp2 (FSDP2 shards the parameters, gradients "
                      f"and optimizer state itself): remove {key} or use_torch_fsdp2")
        for key, why in (("grad_reduce_in_bf16", "FSDP2Step reduce-scatters the gradients in fp32"),
                         ("ddp_bucket_size", "FSDP2 reduces per sharded layer, in no DDP buckets")):
            if getattr(self, key) not in (False, None):
                _fail(key, getattr(self, key), f"does nothing with use_torch_fsdp2 ({why}): remove {key} or "
                      "use_torch_fsdp2")
        self._check_data_parallel_only("use_torch_fsdp2", "FSDP2")

    def _check_megatron_fsdp(self) -> None:
        """What Megatron-FSDP over the data-parallel group cannot combine with (the rest: ``Recipe``).
        ``Recipe.from_dict`` turns the distributed optimizer and both overlaps on for it (a note says
        which): megatron-core's ``MegatronFSDP`` forces the overlaps itself with ``optim_grads_params``,
        and its optimizer is megatron-core's distributed optimizer."""
        if self.use_torch_fsdp2:
            _fail("use_torch_fsdp2", True, "must be false with use_megatron_fsdp (one FSDP shards the model): "
                  "remove use_torch_fsdp2 or use_megatron_fsdp")
        for key in ("use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather"):
            if not getattr(self, key):
                _fail(key, False, f"must be true with use_megatron_fsdp (optim_grads_params steps the shards with "
                      f"megatron-core's distributed optimizer and overlaps both collectives): set {key}=true")
        self._check_data_parallel_only("use_megatron_fsdp", "Megatron-FSDP")

    def _check_data_parallel_only(self, flag: str, name: str) -> None:
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                    "expert_tensor_parallel_size", "context_parallel_size"):
            if getattr(self, key) != 1:
                _fail(key, getattr(self, key), f"must be 1 with {flag} (etp-train's {name} peer shards over the "
                      f"data-parallel ranks only): set {key}=1")

    @property
    def fsdp_peer(self) -> str | None:
        """The FSDP peer's recipe key (``use_torch_fsdp2`` / ``use_megatron_fsdp``) when one is on."""
        return ("use_torch_fsdp2" if self.use_torch_fsdp2 else "use_megatron_fsdp" if self.use_megatron_fsdp
                else None)

    @property
    def distributed_timeout(self) -> datetime.timedelta:
        """``distributed_timeout_minutes`` as the ``timeout`` of ``init_process_group`` / ``new_group``."""
        return datetime.timedelta(minutes=self.distributed_timeout_minutes)

    @property
    def model_parallel_size(self) -> int:
        """TP x PP x CP: the ranks one dense replica spans."""
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )

    @property
    def expert_model_parallel_span(self) -> int:
        """ETP_tp x EP x PP: the ranks one expert replica spans."""
        return (
            self.expert_tensor_parallel_size
            * self.expert_model_parallel_size
            * self.pipeline_model_parallel_size
        )


@dataclass(frozen=True)
class TrainSpec:
    """Batch sizes, optimizer, schedule, precision, logging, checkpoints and data of a recipe.
    ``lr_decay_iters`` defaults to ``train_iters``; ``global_batch_size`` stays None (one
    microbatch per step) until a world size is known, see :meth:`Recipe.global_batch_size`.

    Example::

        TrainSpec(micro_batch_size=4, train_iters=60, lr=3e-3).lr_decay_iters   # 60
    """

    micro_batch_size: int = _positive(None, "samples per rank per microbatch", required=True)
    global_batch_size: int | None = _positive(None, "samples per optimizer step, all ranks")
    train_iters: int = _positive(None, "optimizer steps", required=True)
    lr: float = _key(
        None, _FLOAT, "peak learning rate", required=True, minimum=0.0, exclusive_minimum=True
    )
    min_lr: float = _key(0.0, _FLOAT, "final learning rate", minimum=0.0)
    lr_warmup_iters: int = _key(
        0, _INT, "linear warm-up iterations (longer than train_iters: clipped)", minimum=0)
    lr_warmup_init: float = _key(0.0, _FLOAT, "learning rate the warm-up starts from", minimum=0.0)
    lr_decay_iters: int | None = _positive(None, "iterations from 0 to the end of the decay (then min_lr)")
    lr_decay_style: str = _key("linear", _STR, "learning-rate decay", choices=_LR_DECAY_STYLES)
    lr_wsd_decay_style: str = _key(
        "exponential", _STR, "WSD: the annealing phase's shape", choices=_WSD_DECAY_STYLES)
    lr_wsd_decay_iters: int | None = _key(
        None, _INT, "WSD: iterations of the annealing phase, the last ones of lr_decay_iters", minimum=0)
    weight_decay: float = _key(0.01, _FLOAT, "AdamW weight decay", minimum=0.0)
    weight_decay_incr_style: str = _key(
        "constant", _STR, "weight decay from start_weight_decay to end_weight_decay over train_iters",
        choices=_WEIGHT_DECAY_INCR_STYLES)
    start_weight_decay: float | None = _key(None, _FLOAT, "weight decay at iteration 0 (linear / cosine)",
                                            minimum=0.0)
    end_weight_decay: float | None = _key(None, _FLOAT, "weight decay at train_iters (linear / cosine)",
                                          minimum=0.0)
    override_opt_param_scheduler: bool = _key(
        False, _BOOL, "on resume, the recipe's schedule replaces the checkpoint's (at its iteration)")
    use_checkpoint_opt_param_scheduler: bool = _key(
        False, _BOOL, "on resume, the checkpoint's schedule replaces the recipe's")
    clip_grad: float = _key(1.0, _FLOAT, "global grad-norm clip (0 = off)", minimum=0.0)
    adam_beta1: float = _key(0.9, _FLOAT, "Adam beta1", minimum=0.0, below=1.0)
    adam_beta2: float = _key(0.999, _FLOAT, "Adam beta2", minimum=0.0, below=1.0)
    adam_eps: float = _key(1e-8, _FLOAT, "Adam epsilon", minimum=0.0, exclusive_minimum=True)
    bf16: bool = _key(False, _BOOL, "bf16 parameters and compute")
    fp16: bool = _key(False, _BOOL, "fp16 parameters and compute (refused: no loss scaling; use bf16)")
    seed: int = _key(1234, _INT, "random seed", minimum=0)
    log_interval: int = _positive(100, "steps between log lines")
    save: str | None = _key(None, _STR, "checkpoint directory to save to")
    save_interval: int | None = _positive(None, "steps between checkpoints (unset: one save, after the last step)")
    async_save: bool = _key(False, _BOOL, "the step does not wait for the disk: each save's tensors are copied to "
                            "host, written in the background, and published as latest once every rank's write "
                            "finished (needs save)")
    no_save_optim: bool = _key(False, _BOOL, "save the model weights and the iteration only, no optimizer state "
                               "(a seventh of the bytes in bf16): resuming such a checkpoint needs no_load_optim; "
                               "finetune and etp-convert export-hf read it as any")
    load: str | None = _key(None, _STR, "checkpoint directory to load from")
    finetune: bool = _key(False, _BOOL, "start from load's model weights only: iteration, optimizer and learning-rate "
                          "schedule start fresh (a checkpoint etp-convert import-hf wrote, or any etp-train save)")
    pretrained_checkpoint: str | None = _key(
        None, _STR, "fine-tune from this checkpoint's model weights while load holds no checkpoint, resume from load "
        "once it does: one command line for the first start and every restart (Megatron-LM's; needs load)")
    no_load_optim: bool = _key(False, _BOOL, "--resume without the optimizer state: fresh Adam moments, master "
                               "weights from the model's; the iteration continues")
    no_load_rng: bool = _key(False, _BOOL, "load no RNG state: etp's checkpoints hold none (batches follow the seed "
                             "and the iteration), so both values load the same")
    skip_train: bool = _key(False, _BOOL, "train nothing: evaluate the loaded weights (finetune or --resume) and "
                            "report their loss")
    exit_signal_handler: bool = _key(False, _BOOL, "on SIGTERM, save at the next iteration boundary and exit 0")
    tensorboard_dir: str | None = _key(None, _STR, "write every log interval's figures as TensorBoard scalars here")
    wandb_project: str | None = _key(None, _STR, "log every log interval's figures to this W&B project (offline "
                                     "unless WANDB_MODE says otherwise)")
    wandb_exp_name: str | None = _key(None, _STR, "the W&B run's name")
    wandb_save_dir: str | None = _key(None, _STR, "where W&B writes its files")
    exit_duration_in_mins: float | None = _key(None, _FLOAT, "save and exit 0 after this many minutes", minimum=0.0,
                                               exclusive_minimum=True)
    exit_interval: int | None = _positive(None, "save and exit 0 after an iteration that is a multiple of it")
    data: str = _key(SYNTHETIC, _STR, "'synthetic' or a text corpus path")
    deterministic: bool = _key(
        False, _BOOL, "bitwise-reproducible runs: torch deterministic algorithms, megatron deterministic_mode; "
        "with cuda_graph=step, captured runs train bit for bit like eager ones",
    )
    cuda_graph: str = _key(
        "none", _STR, "none | step: capture each micro-batch's forward + backward in one CUDA graph "
        "(etp.GraphedStep) and replay it", choices=("none", "step"),
    )
    megatron_fallbacks: str = _key(
        "fast", _STR, "fast (torch foreach helpers, fused AdamW and fused RoPE without apex / "
        "TransformerEngine; the optimizer step without a host wait, always) | stock (megatron-core's own "
        "fallbacks and step)", choices=("fast", "stock"),
    )
    peak_tflops: float | None = _key(
        None, _FLOAT, "bf16 peak TFLOP/s per GPU for MFU (default: by GPU name)",
        minimum=0.0, exclusive_minimum=True,
    )
    recompute_granularity: str | None = _key(
        None, _STR, "activation recompute: full (whole layers) | selective (recompute_modules)",
        choices=_RECOMPUTE_GRANULARITIES,
    )
    recompute_method: str | None = _key(
        None, _STR, "layers full recompute covers: uniform | block", choices=_RECOMPUTE_METHODS
    )
    recompute_num_layers: int | None = _positive(
        None, "layers per recompute unit (uniform) or recomputed layers per stage (block)"
    )
    recompute_modules: tuple[str, ...] | None = _key(
        None, _STR_LIST, "submodules selective recompute covers (None: megatron's [core_attn])",
        choices=_RECOMPUTE_MODULES,
    )

    def __post_init__(self) -> None:
        _validate_fields(self)
        decay_given = self.lr_decay_iters is not None
        if not decay_given:
            object.__setattr__(self, "lr_decay_iters", self.train_iters)
        if self.min_lr > self.lr:
            _fail("min_lr", self.min_lr, f"must be <= lr={self.lr}")
        # A short run (a smoke test, --train-iters 4) of a recipe with a longer warm-up: the warm-up
        # is clipped and etp-train says so, rather than refusing the run. It ends before
        # lr_decay_iters, as megatron-core's scheduler requires; one longer than an lr_decay_iters
        # the recipe sets is refused (check_schedule).
        longest = min(self.train_iters, self.lr_decay_iters - 1)
        if self.lr_warmup_iters > longest and not (decay_given and self.lr_warmup_iters >= self.lr_decay_iters):
            object.__setattr__(self, "_warmup_clipped_from", self.lr_warmup_iters)
            object.__setattr__(self, "lr_warmup_iters", longest)
        check_schedule(self)
        if self.bf16 and self.fp16:
            _fail("fp16", True, "bf16 and fp16 are both true: choose one")
        if self.fp16:
            _fail("fp16", True, "is not supported by etp-train: it builds no fp16 model and scales no loss "
                  "(megatron-core's grad scaler would step on unscaled gradients): use bf16: true")
        if self.save_interval is not None and self.save is None:
            _fail("save_interval", self.save_interval, "needs save: a checkpoint directory")
        if self.async_save and self.save is None:
            _fail("async_save", True, "needs save: a checkpoint directory (it says how saves are written)")
        if self.pretrained_checkpoint is not None:
            if self.load is None:
                _fail("pretrained_checkpoint", self.pretrained_checkpoint, "needs load: the directory the run resumes "
                      "from once it has saved (set save to the same), e.g. --set load=CKPT --set save=CKPT")
            if self.finetune:
                _fail("finetune", True, "with pretrained_checkpoint: it fine-tunes from pretrained_checkpoint while load "
                      "holds no checkpoint and resumes from load after; remove finetune")
        for key in ("finetune", "skip_train"):
            if getattr(self, key) and self.load is None:
                _fail(key, True, "needs load: the checkpoint directory to start from (an etp-train save, or one "
                      "etp-convert import-hf wrote), e.g. --set load=CKPT")
        self._check_recompute()

    @property
    def warmup_clipped_from(self) -> int | None:
        """The recipe's ``lr_warmup_iters`` when it was longer than ``train_iters`` (and was
        clipped to it), else None."""
        return getattr(self, "_warmup_clipped_from", None)

    def _check_recompute(self) -> None:
        """The recompute combinations megatron-core's TransformerConfig refuses (or ignores),
        refused here with the fix (the model-dependent ones: :class:`Recipe`)."""
        granularity, method = self.recompute_granularity, self.recompute_method
        layers, modules = self.recompute_num_layers, self.recompute_modules
        modules = None if modules is None else list(modules)  # named as written: a list
        if granularity is None:
            for key, value, needs in (
                ("recompute_method", method, "full"),
                ("recompute_num_layers", layers, "full"),
                ("recompute_modules", modules, "selective"),
            ):
                if value is not None:
                    _fail(
                        key,
                        value,
                        f"does nothing without recompute_granularity: set "
                        f"`recompute_granularity: {needs}` or remove {key}",
                    )
        elif granularity == "full":
            if method is None or layers is None:
                missing = "recompute_method" if method is None else "recompute_num_layers"
                raise RecipeError(
                    missing,
                    None,
                    f"recipe key recompute_granularity='full' needs recompute_method ('uniform' "
                    f"or 'block') and recompute_num_layers (got recompute_method={method!r}, "
                    f"recompute_num_layers={layers!r}): add e.g. `recompute_method: uniform` "
                    "and `recompute_num_layers: 1`",
                )
            if modules is not None:
                _fail(
                    "recompute_modules",
                    modules,
                    "applies only with recompute_granularity: selective (full recomputes whole "
                    "layers): remove recompute_modules or use selective",
                )
        else:  # selective
            for key, value in (("recompute_method", method), ("recompute_num_layers", layers)):
                if value is not None:
                    _fail(
                        key,
                        value,
                        "applies only with recompute_granularity: full (selective recomputes "
                        f"recompute_modules in every layer; megatron-core refuses it): remove {key}",
                    )
            if modules is not None and not modules:
                _fail(
                    "recompute_modules",
                    modules,
                    "is empty: selective recompute would recompute nothing; list modules or "
                    "leave recompute_modules unset for megatron-core's default [core_attn]",
                )
            for module in modules or ():
                if module in _UNSUPPORTED_RECOMPUTE_MODULES:
                    _fail(
                        "recompute_modules",
                        modules,
                        f"{module!r} {_UNSUPPORTED_RECOMPUTE_MODULES[module]}",
                    )

    @property
    def is_synthetic(self) -> bool:
        return self.data == SYNTHETIC

    @property
    def params_dtype(self) -> torch.dtype:
        """The parameters' dtype, as Megatron-LM derives ``args.params_dtype`` from ``bf16`` /
        ``fp16`` (what a gather format is asked whether it takes)."""
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32


@dataclass(frozen=True)
class DataSpec:
    """The corpus, its splits and blends, the tokenizer, per-document masks and validation of a
    recipe (Megatron-LM names and meanings; see ``etp.recipe.data_keys`` and [Note: blends]).
    Without ``data_path`` / ``mock_data`` etp-train reads the ``data`` key (synthetic ids or a
    text file's bytes).

    Example::

        spec = DataSpec(data_path="corpus/wiki_text_document", tokenizer_type="HuggingFaceTokenizer",
                        tokenizer_model="tokenizers/wiki")
        spec.blend, spec.split_shares   # (('corpus/wiki_text_document',), None), (0.969, 0.03, 0.001)
    """

    # The blends are lists or strings (Megatron-LM's --data-path), parsed by check_data_keys.
    data_path: Any = field(default=None, metadata={"help": "prefix, or weight / prefix pairs, of .bin / .idx"})
    split: str | None = field(default=None, metadata={"help": "train, valid, test shares of data_path"})
    train_data_path: Any = field(default=None, metadata={"help": "the train split's own blend"})
    valid_data_path: Any = field(default=None, metadata={"help": "the valid split's own blend"})
    test_data_path: Any = field(default=None, metadata={"help": "the test split's own blend"})
    data_cache_path: str | None = _key(None, _STR, "where the datasets' sample indices are cached")
    mock_data: bool = _key(False, _BOOL, "megatron-core's generated documents instead of a corpus")
    tokenizer_type: str | None = _key(None, _STR, "Megatron-LM tokenizer type (HuggingFaceTokenizer, ...)")
    tokenizer_model: str | None = _key(None, _STR, "local path of the tokenizer (nothing is downloaded)")
    reset_position_ids: bool = _key(False, _BOOL, "position ids restart after each end-of-document token")
    reset_attention_mask: bool = _key(False, _BOOL, "attention does not cross end-of-document tokens")
    eod_mask_loss: bool = _key(False, _BOOL, "end-of-document tokens carry no loss")
    num_workers: int = _key(2, _INT, "data-loader worker processes per rank (0: the rank reads)", minimum=0)
    eval_interval: int = _positive(1000, "iterations between validations")
    eval_iters: int = _key(100, _INT, "global batches per validation (0: none)", minimum=0)

    def __post_init__(self) -> None:
        _validate_fields(self)
        if isinstance(self.split, (int, float)) and not isinstance(self.split, bool):
            object.__setattr__(self, "split", str(self.split))
        check_data_keys(self)
        if self.data_path is not None and self.split is None:
            object.__setattr__(self, "split", DEFAULT_SPLIT)

    @property
    def has_dataset(self) -> bool:
        """Whether etp-train reads megatron-core datasets (``data_path``, a path per split, ``mock_data``)."""
        return self.mock_data or any(getattr(self, key) is not None for key in
                                     ("data_path", "train_data_path", "valid_data_path", "test_data_path"))

    @property
    def blend(self):
        """``data_path`` as ``(prefixes, weights or None)`` (None without it)."""
        return parse_blend("data_path", self.data_path)

    def split_blend(self, split: str):
        """``train_data_path`` / ``valid_data_path`` / ``test_data_path`` of ``split`` (train | valid |
        test) as ``(prefixes, weights or None)``, None when unset."""
        return parse_blend(f"{split}_data_path", getattr(self, f"{split}_data_path"))

    @property
    def split_shares(self) -> tuple[float, float, float] | None:
        """``split`` as normalized (train, valid, test) shares (None without ``data_path``)."""
        return None if self.split is None else parse_split(self.split)


_SECTIONS: dict[str, type] = {"model": ModelSpec, "parallel": ParallelSpec, "train": TrainSpec,
                             "data": DataSpec}
#: flat recipe key -> section attribute of Recipe
_KEY_SECTION: dict[str, str] = {
    f.name: section for section, cls in _SECTIONS.items() for f in dataclasses.fields(cls)
}
_ETP_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ETPConfig))


