"""Training recipes: one YAML file of Megatron-LM argument names plus an ``etp:`` section.

A recipe is flat, like Megatron-LM's own command lines: every top-level key is the ``dest`` of
a Megatron-LM argument (``--num-layers`` -> ``num_layers``; the flag ``--disable-bias-linear``
-> ``add_bias_linear: false``) or one of etp's few driver keys, and the ``etp:`` section holds
exactly the fields of :class:`etp.ETPConfig`. Everything is checked here, before any process
group or GPU exists: unknown keys (with the closest known name), wrong types, out-of-range
values and inconsistent sizes raise :class:`RecipeError` (a ``ValueError``) naming the key and
the value. Checks that need the number of ranks run in :meth:`Recipe.check_world_size`, and
already at load time when the recipe sets ``world_size``.

Example::

    # recipes/tiny_moe_cpu.yaml
    num_layers: 2
    hidden_size: 64
    num_attention_heads: 4
    num_experts: 4
    ...
    etp:
      etp_size: 2
      expert_etp_size: 2

    recipe = Recipe.from_yaml("recipes/tiny_moe_cpu.yaml", train_iters=5)
    recipe.check_world_size(2)
    recipe.model.hidden_size, recipe.etp.etp_size, recipe.data_parallel_size(2)

Schema (key: default; "required" keys have none). Defaults are Megatron-LM's unless marked.

Model (``recipe.model``, :class:`ModelSpec`):
    num_layers, hidden_size, num_attention_heads, seq_length, vocab_size: required.
    ffn_hidden_size: None -> 4*hidden_size, or int(4*hidden_size*2/3 / 64)*64 with swiglu.
    num_query_groups: None -> num_attention_heads (no grouped-query attention; Megatron-LM
        also needs ``group_query_attention``, etp infers it from num_query_groups < heads).
    kv_channels: None -> hidden_size / num_attention_heads (the width of one attention head;
        set it for heads x kv_channels != hidden_size, e.g. Qwen3-MoE's 32 x 128 at width 2048).
    qk_layernorm: false (true: each head's queries and keys normalized, with the normalization's
        kind, before rope; two [kv_channels] weights per layer, replicated under ETP).
    qk_layernorm_width: head (etp's own: what qk_layernorm normalizes | full: the whole
        num_attention_heads x kv_channels query and num_query_groups x kv_channels key as one
        vector each, OLMoE's, etp.megatron.qk_norm.FullWidthQKNorm; RMSNorm and
        tensor_model_parallel_size 1 only).
    norm_epsilon: 1e-05 (every LayerNorm / RMSNorm's epsilon, megatron-core's layernorm_epsilon;
        Qwen3's 1e-06).
    max_position_embeddings: None -> seq_length.
    vocab_size: etp's own reading: the embeddings the model has (before
        make_vocab_size_divisible_by pads them); every token id is below it. With a tokenizer,
        at least its vocabulary (checked before the ranks start); with data (a text file read as
        UTF-8 bytes), at least 256.
    make_vocab_size_divisible_by: 128 (the embedding has padded_vocab_size rows).
    swiglu: false. normalization: LayerNorm (LayerNorm | RMSNorm).
    position_embedding_type: learned_absolute (learned_absolute | rope | none).
    rotary_base: 10000 (the RoPE base period, GPTModel's rotary_base; rope only: Qwen3's and
        Mixtral's 1000000).
    untie_embeddings_and_output_weights: false. add_bias_linear: true.
    init_method_std: 0.02. attention_dropout: 0.1. hidden_dropout: 0.1.
    num_experts: None (a dense model; otherwise the layers moe_layer_freq picks are MoE).
    moe_router_topk: 2. moe_ffn_hidden_size: None -> ffn_hidden_size.
    moe_grouped_gemm: false (true: etp's GroupedSwiGLUExperts, torch._grouped_mm; false:
        megatron-core SequentialMLP experts).
    moe_token_dispatcher_type: allgather (allgather | alltoall | flex | local: etp's own
        etp.megatron.local_dispatcher.LocalTokenDispatcher, no host synchronization, for
        expert_model_parallel_size 1, tensor_model_parallel_size 1 and moe_grouped_gemm; etp:
        etp.megatron.ep_dispatcher.EtpTokenDispatcher over etp.ep's dispatch / combine, any
        expert_model_parallel_size, tensor and expert tensor parallel size 1).
    moe_aux_loss_coeff: 0.0.
    moe_router_load_balancing_type: aux_loss (aux_loss | seq_aux_loss | global_aux_loss |
        sinkhorn | none; one value, not Megatron-LM's list form; none and sinkhorn refuse a
        moe_aux_loss_coeff above 0, which they would ignore).
    moe_layer_freq: 1 (every layer MoE | N: layers 0, N, 2N, ... MoE, the rest dense MLPs of
        ffn_hidden_size | a pattern of one 0 (dense) or 1 (MoE) per layer, a YAML list or
        Megatron-LM's string form ``([0]*3+[1]*58)``, parsed, never evaluated).
    moe_shared_expert_intermediate_size: None (no shared experts | the total width of the shared
        experts, one SwiGLU / GELU MLP every token passes, beside the routed ones; megatron-core's
        SharedExpertMLP, whose linears ETP shards over the dense group; needs add_bias_linear false).
    moe_shared_expert_gate: false (true: the shared output times sigmoid(x . g), Qwen2-MoE style).
    moe_router_score_function: softmax (softmax | sigmoid: DeepSeek-V3's, probabilities
        normalized over the chosen experts).
    moe_router_pre_softmax: false (true: softmax over all experts, then the top-k, unnormalized:
        OLMoE's; softmax only; megatron-core requires it with moe_router_topk 1).
    moe_router_topk_scaling_factor: None (multiplies the routing probabilities: 2.5 in DeepSeek-V3).
    moe_router_enable_expert_bias: false (true: aux-loss-free balancing, a per-expert bias added to
        the scores that choose the top-k, updated by moe_router_bias_update_rate per global batch
        from the token counts all-reduced over the data-parallel ranks; sigmoid only).
    moe_router_bias_update_rate: 0.001.
    moe_router_num_groups, moe_router_group_topk: None (group-limited top-k: experts in
        moe_router_num_groups equal groups, each token routed within its moe_router_group_topk best
        groups, a group scored by its top moe_router_topk / moe_router_group_topk experts; set both).
    moe_z_loss_coeff: None (router z-loss weight).
    attention_backend: sdpa (etp's own: sdpa = etp.megatron.attention.SDPAttention on torch's
        fused SDPA kernels | local = megatron-core's DotProductAttention, full score matrix).

Parallelism (``recipe.parallel``, :class:`ParallelSpec`):
    tensor_model_parallel_size: 1. pipeline_model_parallel_size: 1 (only 1: etp-train runs no
        pipeline schedule; Megatron-LM's virtual_pipeline_model_parallel_size is no recipe key).
    expert_model_parallel_size: 1. expert_tensor_parallel_size: None -> tensor size (megatron-core's
        expert tensor-parallel groups and TransformerConfig get it).
    context_parallel_size: 1 (only 1: etp-train splits no sequence over context-parallel ranks).
    sequence_parallel: false. use_distributed_optimizer: false.
    overlap_grad_reduce: false. overlap_param_gather: false (needs the distributed optimizer and
    overlap_grad_reduce; models without ETP weights). grad_reduce_in_bf16: false (fp32 DDP
    reductions; one rank with one micro-batch keeps bf16 gradients anyway, the same values:
    Recipe.main_grad_bytes). ddp_bucket_size: None (megatron-core's default).
    use_torch_fsdp2: false (true: torch FSDP2 in place of megatron-core DDP and Adam,
        etp.train.baselines.fsdp2.FSDP2Step: fully_shard per TransformerLayer and the root over the
        data-parallel ranks, bf16 gathers with bf16: true, fp32 reductions and master weights, torch
        AdamW; the peer etp is benchmarked against (docs/architectures.md, "Peers"). ETP sizes 1 (auto
        resolves them to 1), TP / PP / CP / EP 1, no distributed optimizer, overlap_param_gather,
        grad_reduce_in_bf16 or ddp_bucket_size, cuda_graph none (auto resolves to none), no fp16, no save / load, dispatcher local, alltoall or
        allgather; it turns overlap_grad_reduce off itself, FSDP2 reduces during the backward).
    use_megatron_fsdp: false (true: megatron-core's own Megatron-FSDP in place of its DDP,
        etp.train.baselines.megatron_fsdp.MegatronFSDPStep: megatron.core.distributed.fsdp's
        FullyShardedDataParallel with data_parallel_sharding_strategy optim_grads_params (parameters,
        gradients and optimizer state sharded per TransformerLayer over the data-parallel ranks) and
        megatron-core's distributed optimizer, bf16 compute with fp32 main weights and gradients; GPUs
        only, the peer etp is benchmarked against (docs/architectures.md, "Peers"). ETP sizes 1 (auto
        resolves them to 1), TP / PP / CP / EP 1, cuda_graph none (auto resolves to none), no fp16, no
        save / load, dispatcher local, alltoall or allgather, not with use_torch_fsdp2; it turns
        use_distributed_optimizer, overlap_grad_reduce and overlap_param_gather on itself).
    world_size: None (etp driver key: ranks the recipe is meant for; the CPU driver spawns
        this many; under torchrun None takes the launcher's, a value must equal WORLD_SIZE).
    backend: auto (etp driver key: auto | gloo | nccl; auto is nccl with CUDA, else gloo).
    distributed_timeout_minutes: 10 (Megatron-LM's: how long a collective of any process group
        waits for a peer that stopped answering before the rank fails, so that the launcher can
        restart the run; the world group's, megatron-core's and every group etp creates; a number
        > 0, fractions allowed (0.5: 30 s); longer than any wait of one rank for another, such as
        a checkpoint save or a dataset index build; [Note: group timeouts] in etp.groups).

Training (``recipe.train``, :class:`TrainSpec`):
    micro_batch_size, train_iters, lr: required. micro_batch_size: auto takes the largest that
        divides each rank's share of global_batch_size (then required) and that the memory audit
        predicts to fit. global_batch_size: None -> micro_batch_size * data_parallel_size (one
        microbatch per step).
    The learning-rate and weight-decay schedule is megatron-core's OptimizerParamScheduler, built
    as Megatron-LM builds it for train_iters (etp.train.schedule; its lengths count samples,
    [Note: the schedule counts samples]); biases and 1-D parameters take no weight decay.
    min_lr: 0.0. lr_warmup_iters: 0 (a linear warm-up from lr_warmup_init at iteration 0 to lr at
        iteration lr_warmup_iters; one that would not end before train_iters, or before an unset
        lr_decay_iters, is clipped, and etp-train says so). lr_warmup_init: 0.0.
    lr_decay_iters: None -> train_iters (counted from iteration 0, the warm-up included; min_lr
        after it).
    lr_decay_style: linear (constant | linear | cosine | inverse-square-root: lr x sqrt(warm-up /
        step), in samples | WSD: lr until the last lr_wsd_decay_iters of lr_decay_iters, then
        lr_wsd_decay_style down to min_lr). lr_wsd_decay_style: exponential (exponential | linear
        | cosine | minus_sqrt). lr_wsd_decay_iters: None (WSD only, and then required).
    weight_decay: 0.01. weight_decay_incr_style: constant (weight_decay throughout | linear |
        cosine: start_weight_decay rising to end_weight_decay over train_iters, both then
        required). start_weight_decay, end_weight_decay: None.
    override_opt_param_scheduler, use_checkpoint_opt_param_scheduler: false (a resume whose
        recipe schedule differs from its checkpoint's is refused unless one is true: the
        recipe's schedule from the checkpoint's iteration on, or the checkpoint's).
    clip_grad: 1.0 (0 = off). adam_beta1: 0.9. adam_beta2: 0.999. adam_eps: 1e-08.
    bf16: false. fp16: false (true is refused: etp-train builds no fp16 model and scales no loss;
        use bf16). seed: 1234. log_interval: 100.
    save: None. save_interval: None (needs save; unset: one save, after the run's last
        iteration). async_save: false (Megatron-LM's: true copies each save's tensors to host, the
        step goes on while a background thread writes them, and the checkpoint becomes latest only
        once every rank's write finished; needs save). load: None. A run refuses a save directory
        that holds another run's checkpoints (each checkpoint names its run ID; etp-train --resume
        or --overwrite; see etp.train.checkpointing).
    finetune: false (Megatron-LM's: true starts from load's model weights only, at iteration 0 with
        a fresh optimizer and learning-rate schedule; needs load; not with --resume; a checkpoint
        etp-convert import-hf wrote holds only weights: docs/hf.md). pretrained_checkpoint: None
        (Megatron-LM's: fine-tune from it while load holds no checkpoint, resume from load once it
        does; needs load, not with finetune). no_load_optim: false (true:
        --resume loads the model and the iteration, not the optimizer state). no_save_optim: false
        (true: saves hold the weights and the iteration, no optimizer state; resuming one needs
        no_load_optim). no_load_rng: false
        (etp's checkpoints hold no RNG state: batches follow seed and iteration, so true and
        false load the same). skip_train: false (true: no training step and no save, the loaded
        weights (finetune or --resume) are evaluated and their loss reported; needs load).
        With load set and holding a checkpoint, a run without --resume resumes from its latest
        (Megatron-LM's load; with load = save one command line serves the first start and every
        restart), and starts fresh while load holds none ([Note: restarts]).
    tensorboard_dir: None. wandb_project: None. wandb_exp_name: None. wandb_save_dir: None
        (Megatron-LM's: every log interval's figures as TensorBoard scalars / a W&B run, offline
        unless WANDB_MODE says otherwise; optional extras, pip install -e ".[metrics]"; besides,
        --json RUN.json streams them to RUN.jsonl as the run goes: [Note: the metrics stream]).
    exit_signal_handler: false. exit_duration_in_mins: None. exit_interval: None (Megatron-LM's:
        on SIGTERM / after that many minutes / after an iteration that is a multiple of N, the
        run saves (with save) and exits 0; [Note: early exits] in etp.train.exits).
    data: synthetic (etp's own: "synthetic" for random token ids, or the path of a text
        corpus, read as bytes (memory-mapped), random windows of it; a relative path is looked up
        from the working directory, the recipe's directory and the directory holding the etp
        package, see :meth:`Recipe.resolve_data_path`; not with data_path or mock_data).
    deterministic: false (true: torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG,
        megatron-core deterministic_mode, deterministic SDPA kernels; bitwise-equal reruns;
        with cuda_graph step the embedding's backward is etp.kernels.embedding_backward in
        captured and eager runs alike, so the two train bit for bit alike).
    cuda_graph: none (etp's own | step: etp-train captures one micro-batch's forward + backward in
        a CUDA graph with etp.GraphedStep after three eager warm-ups and replays it for every
        micro-batch; needs CUDA, moe_token_dispatcher_type local or etp for MoE models (megatron's
        dispatchers synchronize with the host; etp's then gives the experts its padded receive
        buffers with device counts and moves tokens with a backend that reads no split sizes on
        the host), no recompute, TP 1; it turns overlap_grad_reduce
        off itself | auto: step where the recipe and the machine allow it).
    megatron_fallbacks: fast (etp's own: without apex / TransformerEngine, megatron-core's
        multi-tensor helpers run as torch foreach ops and torch's Adam as its fused kernel,
        etp.megatron.fast_fallbacks (etp's optimizer: etp's fused AdamW, etp.megatron.fused_adamw),
        and RoPE as one fused pass each way, etp.megatron.rope (every system, the same bits);
        and, with or without apex, the optimizer step keeps the grad
        norm and the clip on the device, etp.megatron.sync_free_optimizer | stock: megatron-core's own
        per-tensor fallbacks and its step, which reads the norm on the host).
    peak_tflops: None (etp's own: bf16 peak TFLOP/s per GPU for the MFU column; None -> by GPU
        name, etp.train.flops.PEAK_TFLOPS).
    Activation recompute, passed unchanged to megatron-core's TransformerConfig
    (:meth:`Recipe.recompute_kwargs`; etp-train's GPTModel, on CPU and GPUs):
    recompute_granularity: None (no recompute | full: whole layers, only their inputs kept |
        selective: the recompute_modules of every layer).
    recompute_method: None (full only, and then required: uniform = chunks of
        recompute_num_layers layers | block = the first recompute_num_layers layers of each
        pipeline stage).
    recompute_num_layers: None (full only, and then required; 1..num_layers / PP).
    recompute_modules: None (selective only; a list, None -> megatron-core's [core_attn]; of
        core_attn, layernorm, mlp (dense layers), moe (MoE layers), shared_experts (with
        moe_shared_expert_intermediate_size); megatron-core's moe_act and mla_up_proj are refused:
        etp's models have none of those parts).
        ``--set recompute_modules=[core_attn,moe]``.

Data (``recipe.data``, :class:`DataSpec`; Megatron-LM's names and meanings, read through
megatron-core's ``GPTDataset`` and tokenizers, ``etp.data``; docs/data.md). Relative paths are
looked up like data's; what the files hold is checked before any rank starts (etp.data.checks):
    data_path: None (Megatron-LM's --data-path: a prefix of a .bin / .idx pair as etp-preprocess
        writes it, several prefixes, or weight / prefix pairs [0.3, a, 0.7, b], or the string
        "0.3 a 0.7 b"; see [Note: blends] in etp/recipe/data_keys.py).
    split: None -> "969,30,1" with data_path (train, valid, test shares of each prefix's documents).
    train_data_path, valid_data_path, test_data_path: None (a blend per split, instead of data_path
        and split; a split without one is not read).
    data_cache_path: None (where megatron-core caches each dataset's sample indices; None: a
        cache/ directory beside each prefix).
    mock_data: false (megatron-core's MockGPTDataset: generated documents, no files).
    tokenizer_type: None (required with data_path / mock_data: HuggingFaceTokenizer,
        SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer, TikTokenizer or
        NullTokenizer, whose ids are below vocab_size - 1 and vocab_size - 1 ends a document).
    tokenizer_model: None (the tokenizer's local path: a Hugging Face tokenizer directory, a
        SentencePiece or tiktoken model file; nothing is downloaded).
    reset_position_ids: false (positions restart after each end-of-document token).
    reset_attention_mask: false (true: a token attends only to its own document: FlexAttention
        under the documents' block mask on GPUs, SDPA under the block-diagonal causal mask on
        CPU or with attention dropout; [Note: document attention] in
        etp/megatron/document_attention.py).
    eod_mask_loss: false (end-of-document tokens carry no loss).
    num_workers: 2 (DataLoader worker processes per rank reading ahead; 0: the rank reads).
    eval_interval: 1000 (iterations between validations; the run's end validates too).
    eval_iters: 100 (global batches of the valid split per validation, and of the test split at
        the end; 0: no validation).

``auto`` (``AUTO_KEYS``: cuda_graph, etp.etp_size, etp.expert_etp_size, etp.gather_dtype,
etp.gather_reuse, micro_batch_size) is chosen at start-up for the machine, each choice printed with its reason:
see [Note: auto settings] in ``etp/train/auto.py``.

ETP (``recipe.etp``, :class:`etp.ETPConfig`): etp_size, expert_etp_size, pad_for_alignment,
    reduction, gather_dtype, fp8_wgrad, gather_reuse, prefetch, async_reduce, debug_checks,
    transport (defaults in configs/etp.yaml; ``tests/recipe/test_recipe.py`` checks this list
    against the dataclass). A removed setting (``etp.REMOVED_SETTINGS``) is refused with what
    replaced it.

[Note: ETP inside the parallel layout]
Megatron-LM splits the world as ``world = TP x CP x PP x DP`` for dense weights and
``world = ETP_tp x EP x PP x EDP`` for experts (ETP_tp = expert_tensor_parallel_size, EDP the
expert-data-parallel size). ETP is a sub-axis of data parallelism: a dense weight is sharded
over ``etp_size`` ranks of its data-parallel group (so ``etp_size`` divides DP) and an expert
weight over ``expert_etp_size`` ranks of its expert-data-parallel group (so
``expert_etp_size`` divides EDP). DDP then reduces over the remaining ``DP / etp_size``
(``EDP / expert_etp_size``) replicas.

YAML 1.1 (PyYAML) reads ``3e-3`` as a string; recipes are loaded with a loader that reads it
as the float it looks like, and duplicate keys are errors.
"""
from etp.recipe.loading import load_recipe_yaml, parse_overrides
from etp.recipe.recipe import AUTO_KEYS, Recipe
from etp.recipe.schema import DataSpec, ModelSpec, ParallelSpec, TrainSpec
from etp.recipe.validation import RecipeError, check_parallel_layout

__all__ = [
    "AUTO_KEYS",
    "DataSpec",
    "ModelSpec",
    "ParallelSpec",
    "Recipe",
    "RecipeError",
    "TrainSpec",
    "check_parallel_layout",
    "load_recipe_yaml",
    "parse_overrides",
]
