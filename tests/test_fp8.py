"""FP8 weight gathers: once-per-step quantization (against an independent quantization of the
full weight), one amax launch / one all-reduce / one cast, one byte per element on the wire
(and what each format's object says it costs), training numerics vs BF16 gathers, and the FP8
GEMMs (GPU) vs the dequantized path."""
import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from torch import nn

import etp.formats.fp8_tensorwise as tensorwise_module
import etp.quant as quant_module
from etp import (
    ETPConfig,
    ETPShardedParam,
    GroupedSwiGLUExperts,
    build_etp_groups,
    finalize_grads,
    quantize_shards,
    wrap_module_params_etp,
)
from etp.formats import gather_format
from etp.formats.fp8 import FP8Weight, scale_rows
from etp.formats.fp8_tensorwise import FP8Tensorwise
from etp.gemm import DenseGemm, GroupedGemm
from etp.kernels import MultiTensorCastPlan

FP8_MAX = 448.0


class Model(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.inp = nn.Linear(32, 48, dtype=dtype)
        self.experts = GroupedSwiGLUExperts(3, 48, 32, dtype=dtype, init_std=0.2)
        self.out = nn.Linear(48, 5, dtype=dtype)

    def forward(self, x, counts):
        h = torch.tanh(self.inp(x))
        return self.out(h + self.experts(h, counts))


COUNTS = torch.tensor([6, 2, 8])


def _reference_tensorwise(full: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """Independent FP8 quantization of a full weight: per weight (2-D) or per expert (3-D),
    scale = 448 / amax (of ``full``, or the given one) computed in float64, cast with torch's
    round-to-nearest-even."""
    w = full.double()
    if amax is not None:
        amax = amax.double().view(-1, 1, 1) if w.dim() == 3 else amax.double().reshape(())
    elif w.dim() == 3:
        amax = w.abs().amax(dim=(1, 2), keepdim=True)
    else:
        amax = w.abs().amax()
    scale = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax)).float().double()
    return (w * scale).clamp(-FP8_MAX, FP8_MAX).float().to(torch.float8_e4m3fn)


def _gather_quantized(param) -> torch.Tensor:
    state = param.etp_runtime.gathers.state(param)
    shards = [torch.empty_like(state.quant.data.view(torch.uint8)) for _ in range(param.etp_group.size)]
    torch.distributed.all_gather(shards, state.quant.data.view(torch.uint8).contiguous(), group=param.etp_group.ag_group)
    return torch.cat(shards).cpu()  # the references are computed on the CPU


def _quantization(ctx, mode):
    align = 128 if mode == "fp8_blockwise" else 4
    # Delayed weight scaling: its first quantization is current scaling (no history yet),
    # checked below like any; the second step is checked after the weights change.
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, gather_dtype=mode,
                       pad_for_alignment=align)
    torch.manual_seed(3)
    model = Model()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.to(ctx.device)
    wrap_module_params_etp(model, config, build_etp_groups(config))
    calls = {"amax": 0, "cast": 0, "all_reduce": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    # The casts run through the tensorwise plan's MultiTensorCastPlan (its tables kept).
    targets = ((tensorwise_module, "multi_tensor_amax", "amax"), (MultiTensorCastPlan, "run", "cast"),
               (torch.distributed, "all_reduce", "all_reduce"))
    originals = [getattr(obj, attr) for obj, attr, _ in targets]

    def count_calls():
        for (obj, attr, name), fn in zip(targets, originals):
            setattr(obj, attr, counted(name, fn))

    def restore():
        for (obj, attr, _), fn in zip(targets, originals):
            setattr(obj, attr, fn)

    count_calls()
    try:
        assert quantize_shards(model) == 4
    finally:
        restore()
    _check_against_reference(model, full, mode)
    if mode != "fp8_tensorwise":
        return calls
    # Delayed scaling, step 2: expert 0 and the dense weights grow (re-cast with their own
    # scale: nothing saturates), experts 1 and 2 shrink (cast with the previous step's amax).
    # Both against the independent float64 quantization; no amax pass, one cast, one re-cast.
    prev_amax = {n: (w.abs().amax(dim=(1, 2)) if w.dim() == 3 else w.abs().amax()) for n, w in full.items()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if isinstance(p, ETPShardedParam):
                layout = p.etp_layout
                grown = full[name] * (torch.tensor([1.5, 0.5, 0.75]).view(-1, 1, 1) if full[name].dim() == 3 else 1.25)
                rows = grown.reshape(layout.rows, -1)[layout.row_start:layout.row_start + layout.valid_rows]
                p[: layout.valid_rows].copy_(rows.view_as(p[: layout.valid_rows]))
                full[name] = grown
    step2 = {"amax": 0, "cast": 0, "all_reduce": 0}
    calls_before = dict(calls)
    count_calls()
    try:
        quantize_shards(model)
    finally:
        restore()
    for key in step2:
        step2[key] = calls[key] - calls_before[key]
    assert step2 == {"amax": 0, "cast": 2, "all_reduce": 1}, step2
    for name, p in model.named_parameters():
        if not isinstance(p, ETPShardedParam):
            continue
        w = full[name]
        new_amax = w.abs().amax(dim=(1, 2)) if w.dim() == 3 else w.abs().amax()
        used = torch.where(new_amax > prev_amax[name], new_amax, prev_amax[name])
        got = _gather_quantized(p)[: p.etp_layout.rows].view(p.etp_layout.logical_shape)
        assert torch.equal(got, _reference_tensorwise(w, used).view(torch.uint8)), name
        scale = p.etp_runtime.fp8_shard(p).scale.double().cpu()
        torch.testing.assert_close(scale, (FP8_MAX / used.double()).float().double().reshape(scale.shape))
        # The scaled GEMMs' per-column weight scales were made by this quantization (both GEMMs'
        # widths), so no GEMM makes them: asking again returns the very tensors, current.
        scale_inv = p.etp_runtime.fp8_shard(p).scale_inv
        made = dict(scale_inv.__dict__.get("_etp_derived", {}))
        groups = w.shape[0] if w.dim() == 3 else 1
        for n in w.shape[-2:]:
            version, rows = made[("scale_rows", groups, n)]
            assert version == scale_inv._version and scale_rows(scale_inv, groups, n) is rows
            want = (used.double().reshape(groups, 1) / FP8_MAX).expand(groups, n)
            torch.testing.assert_close(rows.double().cpu(), want, rtol=2**-23, atol=0)
    return calls


def _check_against_reference(model, full, mode) -> None:
    for name, p in model.named_parameters():
        if not isinstance(p, ETPShardedParam):
            continue
        gathered = _gather_quantized(p)
        layout = p.etp_layout
        assert torch.count_nonzero(gathered[layout.rows:]) == 0, f"{name}: padding rows not zero"
        got = gathered[: layout.rows].view(layout.logical_shape)
        if mode == "fp8_tensorwise":
            want = _reference_tensorwise(full[name]).view(torch.uint8)
        else:
            from etp.kernels.reference import quantize_blockwise_ref

            padded = torch.zeros(layout.padded_shape)
            padded[: layout.rows] = full[name].reshape(layout.rows, -1)
            want = quantize_blockwise_ref(padded, 128, 128)[0][: layout.rows].view(torch.uint8)
            want = want.view(layout.logical_shape)
        assert torch.equal(got, want), f"{name}: FP8 shard differs from the reference quantization"


@pytest.mark.parametrize("size", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: a heavier repeat of 2
def test_tensorwise_quantization_one_launch_one_all_reduce(size):
    for calls in run_distributed(_quantization, size, "fp8_tensorwise"):
        # One ETP group (dense and expert sizes equal): one amax launch, one all-reduce, one
        # cast; then the delayed step: no amax launch, one all-reduce, the cast and re-cast.
        assert calls == {"amax": 1, "cast": 3, "all_reduce": 2}


def test_blockwise_quantization_is_local():
    for calls in run_distributed(_quantization, 2, "fp8_blockwise"):
        assert calls["all_reduce"] == 0


def _moved_shards(ctx):
    # quantize_shards keeps its per-group plan (views of the shards, FP8 destinations) while the
    # shards stay where they are. A shard moved to new storage (megatron DDP's buffers do that)
    # with new values must be cast from there: a stale plan would cast the old storage. The new
    # values grow (x -2), so the delayed scales are re-made from them, as a first quantization's.
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, gather_dtype="fp8_tensorwise",
                       pad_for_alignment=4)
    torch.manual_seed(3)
    model = Model()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.to(ctx.device)
    wrap_module_params_etp(model, config, build_etp_groups(config))
    quantize_shards(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if isinstance(p, ETPShardedParam):
                moved = p.detach().clone() * -2.0
                assert moved.data_ptr() != p.data_ptr()
                p.data = moved
                full[name] = full[name] * -2.0
    quantize_shards(model)
    _check_against_reference(model, full, "fp8_tensorwise")


def test_quantization_follows_shards_to_new_storage():
    run_distributed(_moved_shards, 2)


def _wire_bytes(ctx, mode):
    align = 128 if mode == "fp8_blockwise" else 16  # the model is fp32
    # NCCL gathers: the copy-engine transport (auto's choice on GPUs) moves bytes without
    # all_gather_tensor; its bytes are tested in test_transport_gpu.py.
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, gather_dtype=mode,
                       pad_for_alignment=align, transport="nccl")
    torch.manual_seed(3)
    model = Model().to(ctx.device)
    groups = build_etp_groups(config)
    wrap_module_params_etp(model, config, groups)
    shard_elements = {p.numel(): p for p in model.parameters() if isinstance(p, ETPShardedParam)}
    moved = []
    import etp.collectives as collectives_module

    original = collectives_module.all_gather_tensor

    def recording(out, inp, group=None, async_op=False):
        moved.append((inp.numel() * inp.element_size(), inp.numel(), inp.dtype))
        return original(out, inp, group=group, async_op=async_op)

    # Every all-gather etp issues goes through this one function (weights and block scales).
    collectives_module.all_gather_tensor = quant_module.all_gather_tensor = recording
    try:
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(ctx.rank)).to(ctx.device)
        for _ in range(2):  # the second step replays the prefetch chains
            moved.clear()
            model(x, COUNTS).square().mean().backward()
            finalize_grads(model, config, groups)
    finally:
        collectives_module.all_gather_tensor = quant_module.all_gather_tensor = original
    weight_gathers = [m for m in moved if m[1] in shard_elements]
    scale_gathers = [m for m in moved if m[1] not in shard_elements]
    return weight_gathers, scale_gathers, sum(shard_elements)


@pytest.mark.parametrize("mode,element_bytes", [("fp8_tensorwise", 1), ("fp8_blockwise", 1), ("bf16", 2),
                                                pytest.param("param", 4, marks=pytest.mark.slow)])  # as bf16's
def test_each_weight_element_costs_its_formats_bytes(mode, element_bytes):
    weight_gathers, scale_gathers, elements = run_distributed(_wire_bytes, 2, mode)[0]
    assert weight_gathers and all(nbytes == element_bytes * numel for nbytes, numel, _ in weight_gathers)
    # What the memory audit counts for a gather buffer is what travels.
    fmt = gather_format(mode)
    assert all(fmt.gathered_bytes(numel, 1, param_bytes=4) == nbytes for nbytes, numel, _ in weight_gathers)
    if element_bytes == 1:
        assert all(dtype == torch.uint8 for _, _, dtype in weight_gathers)  # fp8 bytes as uint8
    # Scales travel once per step, in quantize_shards (all-reduce for tensorwise, one
    # all-gather for blockwise), not with every gather: at most 4 bytes per 128x128 block.
    assert sum(n for n, _, _ in scale_gathers) <= 4 * -(-elements // (128 * 128)) * 4


def _train(ctx, mode, steps):
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, gather_dtype=mode,
                       pad_for_alignment=128 if mode == "fp8_blockwise" else 16)
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    torch.manual_seed(5)
    model = Model(dtype).to(ctx.device)
    groups = build_etp_groups(config)
    wrap_module_params_etp(model, config, groups)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    quantized = []
    original = FP8Tensorwise.quantize
    FP8Tensorwise.quantize = lambda self, *a: (quantized.append(1), original(self, *a))[1]
    losses = []
    try:
        for step in range(steps):
            opt.zero_grad()
            for micro in range(2):  # two microbatches per optimizer step
                gen = torch.Generator().manual_seed(1000 * step + 10 * ctx.rank + micro)
                x = torch.randn(16, 32, generator=gen).to(ctx.device, dtype)
                # A target the model can learn (a fixed function of x, plus noise): the runs must
                # learn, not only stay close.
                target = (x[:, :5].cpu() + 0.1 * torch.randn(16, 5, generator=gen)).to(ctx.device, dtype)
                loss = F.mse_loss(model(x, COUNTS).float(), target.float())
                loss.backward()
                losses.append(loss.item())
            finalize_grads(model, config, groups)
            opt.step()
    finally:
        FP8Tensorwise.quantize = original
    return losses, len(quantized)


def test_fp8_training_tracks_bf16_gathers():
    # The same 30 steps with FP8 and with 16-bit weight gathers. FP8 e4m3 rounds each weight
    # to 3 mantissa bits (relative error <= 2^-4, ~2% rms); Adam's normalized steps keep the
    # trajectories close, so every microbatch loss stays within 5% (measured: < 1% on CPU) and the
    # FP8 run learns as much.
    steps = 30
    fp8 = run_distributed(_train, 2, "fp8_tensorwise", steps)
    ref = run_distributed(_train, 2, "param", steps)
    for (fp8_losses, quantizations), (ref_losses, _) in zip(fp8, ref):
        assert quantizations == steps  # once per optimizer step, not per microbatch
        for a, b in zip(fp8_losses, ref_losses):
            assert abs(a - b) <= 0.05 * abs(b), (a, b)
        assert sum(fp8_losses[-10:]) < 0.9 * sum(fp8_losses[:10]), (fp8_losses[:10], fp8_losses[-10:])


# ---------------------------------------------------------------- GPU: FP8 GEMMs
gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
    reason="FP8 GEMMs (torch._scaled_mm / _scaled_grouped_mm) need an sm90+ GPU",
)


def _fp8_weight_plain(w: torch.Tensor) -> FP8Weight:
    q = _reference_tensorwise(w.float().cpu()).cuda()
    amax = w.float().abs().amax(dim=tuple(range(1, w.dim())) if w.dim() == 3 else None)
    scale = (FP8_MAX / amax).reshape(-1).float()
    rows = q.numel() // q.shape[-1]
    return FP8Weight(q, scale, 1.0 / scale, False, q.view(rows, -1), rows)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@gpu
def test_scaled_gemms_match_dequantized_path():
    """The fast-accumulating scaled GEMMs (the input gradient's reading the transposed gathered
    bytes) stay within the same bound of the dequantized bf16 GEMMs."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 512, device="cuda", generator=gen, dtype=torch.bfloat16)
    gy = torch.randn(256, 384, device="cuda", generator=gen, dtype=torch.bfloat16)
    _fp8_weight = _fp8_weight_plain
    w = _fp8_weight(torch.randn(384, 512, device="cuda", generator=gen) * 0.02)
    dense_w = w.dequantize(torch.bfloat16)
    # Only the activation's on-the-fly quantization differs: relative error ~2^-5 rms.
    assert _rel(DenseGemm.forward(x, w, None), F.linear(x, dense_w)) < 0.05
    assert _rel(DenseGemm.dgrad(gy, w, None), gy @ dense_w) < 0.05

    counts = torch.tensor([64, 0, 128, 64], device="cuda")
    we = _fp8_weight(torch.randn(4, 384, 512, device="cuda", generator=gen) * 0.02)
    dense_we = we.dequantize(torch.bfloat16)
    ref_y = torch.cat([xe @ dense_we[e].t() for e, xe in enumerate(torch.split(x, counts.tolist()))])
    ref_dx = torch.cat([ge @ dense_we[e] for e, ge in enumerate(torch.split(gy, counts.tolist()))])
    assert _rel(GroupedGemm.forward(x, we, counts), ref_y) < 0.05
    assert _rel(GroupedGemm.dgrad(gy, we, counts), ref_dx) < 0.05
