"""The predicted peak of a captured step (``cuda_graph: step``) and of the weight gradients
reduced without a pool buffer, against byte counts made by hand for a one-layer MoE recipe
([Note: predicted peak] in etp/audit/predict.py)."""
from etp.audit import activation_bytes, predict_peak
from etp.recipe import Recipe

# One MoE layer of width 64, 8 experts of FFN 32 (SwiGLU), vocabulary 256, 2 x 16 tokens;
# ETP 2 for every weight, 16-row alignment (units of 32 rows).
TINY = dict(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=256,
            num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, moe_grouped_gemm=True,
            moe_token_dispatcher_type="local", swiglu=True, add_bias_linear=False, normalization="RMSNorm",
            position_embedding_type="rope", untie_embeddings_and_output_weights=True, micro_batch_size=2,
            train_iters=1, lr=1e-3, bf16=True, world_size=2, overlap_grad_reduce=False,
            etp={"etp_size": 2, "expert_etp_size": 2, "pad_for_alignment": 16})

# Replicated on each rank: embedding 256 x 64, 3 RMSNorms of 64, router 8 x 64 (dense group).
REPLICATED = 256 * 64 + 3 * 64 + 8 * 64
# Shards: qkv 192 -> 96 x 64, proj 64 -> 32 x 64, fc1 8 x 64 rows -> 256 x 64,
# fc2 8 x 64 rows -> 256 x 32, output 256 -> 128 x 64.
ELEMENTS = REPLICATED + 96 * 64 + 32 * 64 + 256 * 64 + 256 * 32 + 128 * 64
# The bf16 logits etp's cross-entropy keeps, 2 bytes x s x b x V; its backward writes their
# gradient over them, adding nothing.
LOGITS = 2 * 16 * 2 * 256
# fc2's and fc1's full bf16 gradients, reduced from the grouped GEMM's output on the push
# reduction's 16-bit wire, alive together (fc2's reduce-scatter pending while fc1's is written),
# beside fc1's backward transients (etp/audit/activations.py, expert_backward_bytes): per row of 2 x 16 tokens x
# top-2, its input gathered again (64), the SwiGLU's input gradient (2 x 32) and fc1's input
# gradient (64), bf16 (bf16 gathers: no FP8 copies).
EXPERT_BACKWARD = 2 * (2 * 16 * 2) * (64 + 2 * 32 + 64)
IN_PLACE_PAIR = 2 * (8 * 64 * 64 + 8 * 64 * 32) + EXPERT_BACKWARD


def test_pool_holds_only_the_dense_gradients_on_a_sixteen_bit_wire():
    recipe = Recipe.from_dict(TINY)
    push = predict_peak(recipe, 2, transport="copy_engine")
    # qkv (192 x 64), proj (64 x 64), output (256 x 64) in bf16; no expert buffer.
    assert push["categories"]["wgrad_pool"] == 2 * (192 * 64 + 64 * 64 + 256 * 64)
    # Over the fp32 wire every gradient is copied into a pool buffer, fc1's (512 x 64) and
    # fc2's (512 x 32) too.
    nccl = predict_peak(recipe, 2, transport="nccl")
    assert nccl["categories"]["wgrad_pool"] == 4 * (192 * 64 + 64 * 64 + 256 * 64 + 512 * 64 + 512 * 32)
    # The in-place pair comes after the output layer's backward released the logits.
    assert push["backward_transient"] == IN_PLACE_PAIR - LOGITS > 0
    assert nccl["backward_transient"] == max(0, EXPERT_BACKWARD - LOGITS)  # fc1's backward transients alone


def test_captured_step_peaks_at_capture_or_step_without_activations():
    eager = predict_peak(Recipe.from_dict({**TINY, "cuda_graph": "none"}), 2, transport="copy_engine")
    captured = predict_peak(Recipe.from_dict({**TINY, "cuda_graph": "step"}), 2, transport="copy_engine")
    activations = activation_bytes(Recipe.from_dict(TINY))
    steady = eager["steady"]  # categories less the shards in symmetric memory
    assert captured["steady"] == steady and captured["categories"]["activations"] == activations
    # The finalize's flat fp32 copy of the replicated gradients (all-reduced over ETP 2).
    finalize = 4 * REPLICATED
    assert eager["finalize_transient"] == captured["finalize_transient"] == finalize
    # Eager: activations and the backward transient on top of everything; the step without them.
    assert eager["forward_backward"] == steady + IN_PLACE_PAIR - LOGITS
    assert eager["optimizer_step"] == captured["optimizer_step"] == steady - activations + finalize
    assert eager["graph_pool"] == 0 and eager["fit_peak"] == eager["peak"]
    # Captured: the capture runs before Adam's first step (no moments, 8 bytes per element)
    # while GraphedStep keeps a copy of every fp32 main_grad (4 bytes per element).
    assert captured["forward_backward"] == steady + IN_PLACE_PAIR - LOGITS - 8 * ELEMENTS + 4 * ELEMENTS
    assert captured["peak"] == max(captured["forward_backward"], captured["optimizer_step"])
    assert captured["peak_phase"] == "optimizer_step"
    # After the capture the activations sit in the graph's private pool: reserved, not
    # allocated, beside the optimizer step; the fit counts them there.
    assert captured["graph_pool"] == activations + IN_PLACE_PAIR - LOGITS
    assert captured["fit_peak"] == captured["optimizer_step"] + captured["graph_pool"] > captured["peak"]
    assert captured["device_peak"] == captured["fit_peak"] + captured["outside_allocator"]


def test_capture_is_the_peak_when_activations_outweigh_the_moments():
    recipe = Recipe.from_dict({**TINY, "cuda_graph": "step", "micro_batch_size": 64})
    peak = predict_peak(recipe, 2, transport="copy_engine")
    assert peak["peak_phase"] == "capture" and peak["peak"] == peak["forward_backward"]
    assert peak["fit_peak"] == max(peak["peak"], peak["optimizer_step"] + peak["graph_pool"])


def test_ep_dispatcher_buffers_counted_outside_the_allocator():
    """etp's EP dispatcher (per MoE layer): receive rows and their gradient [C, h] and the fp32
    routing weights [C], plus two backends' staging ([C, h] + [C]) and per-token tables, the
    larger kind's (here symm_allgather: a row per (rank, token) slot and a copy of the rank's
    tokens, int64 maps of C and of EP x T x topk). C = EP 2 x T 32 x min(topk 2, 4 experts per
    rank) = 128 rows."""
    from etp.audit import ep_dispatcher_bytes

    ep = Recipe.from_dict({**TINY, "moe_token_dispatcher_type": "etp", "expert_model_parallel_size": 2,
                           "cuda_graph": "none", "etp": {**TINY["etp"], "expert_etp_size": 1}})
    rows, tokens, row = 128, 32, 64 * 2
    dispatcher = 2 * rows * row + 4 * rows
    push = tokens * 2 * row + 8 * rows + 8 * 2 * tokens * 2
    dedup = 2 * tokens * row + 8 * rows + 8 * 2 * tokens * 2 + tokens * row
    assert dedup > push
    assert ep_dispatcher_bytes(ep) == dispatcher + 2 * (rows * row + 4 * rows + dedup)
    local = predict_peak(Recipe.from_dict(TINY), 2, transport="copy_engine")
    with_ep = predict_peak(ep, 2, transport="copy_engine")
    assert ep_dispatcher_bytes(Recipe.from_dict(TINY)) == 0
    assert with_ep["outside_allocator"] - ep_dispatcher_bytes(ep) < local["outside_allocator"] + 1
