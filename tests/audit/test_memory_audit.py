"""The runtime memory audit: every measured category against hand-computed byte counts on 2
gloo ranks, None for phase peaks off CUDA, the JSON schema, compare() arithmetic, megatron
optimizer layouts, the cache / pool logging flag, and (on a GPU) the allocator peaks."""
import json
import logging

import pytest
import torch
from harness import run_distributed
from torch import nn

from etp import ETPConfig, build_etp_groups, finalize_grads, wrap_module_params_etp
from etp.audit import CATEGORIES, MemoryAudit
from etp.transport.symm_pool import _ALIGN as SLOT_ALIGN

F32 = 4  # bytes per fp32 element
# Hand counts for nn.Linear(8, 30) -> nn.Linear(30, 8) over ETP = 2 with pad_for_alignment 4:
# rows are padded to a multiple of 4 x 2 = 8, then split in two.
#   0.weight [30, 8]: 30 -> 32 padded rows -> a [16, 8] shard; the gather buffer is [32, 8]
#   2.weight [8, 30]:  8 ->  8 padded rows -> a [4, 30] shard;  the gather buffer is [8, 30]
#   biases (30 and 8 elements) stay replicated.
# Backward gathers 2.weight only (for its input gradient): the input of 0 needs no gradient.
SHARD_ELEMENTS = 16 * 8 + 4 * 30
PARAM_ELEMENTS = SHARD_ELEMENTS + 30 + 8
GATHERED_ELEMENTS = 32 * 8 + 8 * 30
GATHERED_BWD_ELEMENTS = 8 * 30
NUM_PARAMS = 4


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 30), nn.ReLU(), nn.Linear(30, 8))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def _train_one_step(ctx, config):
    """One audited Adam step of the wrapped model; returns (report, etp.cache records)."""
    handler, logger = _Records(), logging.getLogger("etp")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)  # the flag alone must decide whether anything is logged
    try:
        groups = build_etp_groups(config)
        model = _model().to(ctx.device)
        wrap_module_params_etp(model, config, groups)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        audit = MemoryAudit(model, opt)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(ctx.rank)).to(ctx.device)
        with audit.phase("forward"):
            loss = model(x).square().mean()
        with audit.phase("backward"):
            loss.backward()
            finalize_grads(model, config, groups)
        with audit.phase("optimizer"):
            opt.step()
        audit.step_done()
        return audit.report(), [r for r in handler.records if r.name == "etp.cache"]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _audit_ranks(ctx):
    # prefetch off: every (weight, role) gathers into a ticket buffer of its own, and the two
    # padded shapes differ, so each role holds exactly the weights it gathered.
    base = ETPConfig(etp_size=2, pad_for_alignment=4, prefetch=False)
    report, records = _train_one_step(ctx, base)
    assert records == [], [r.getMessage() for r in records]  # silent by default, even at DEBUG

    params = PARAM_ELEMENTS * F32
    # On CUDA the shards live in the copy-engine transport's symmetric pool, whose slots start
    # on SLOT_ALIGN-byte boundaries: the pool's storage, alignment included, is what they hold.
    held = params
    if ctx.device.type == "cuda":
        held = sum(-(-n * F32 // SLOT_ALIGN) * SLOT_ALIGN for n in (16 * 8, 4 * 30)) + (30 + 8) * F32
    # Adam: exp_avg + exp_avg_sq like each param, plus a 0-dim fp32 "step" per param, which
    # torch keeps on the host (only tensors on the audited device count).
    steps = NUM_PARAMS * F32 if ctx.device.type == "cpu" else 0
    adam = 2 * PARAM_ELEMENTS * F32 + steps
    expected = {"params": held, "main_grad": params, "optimizer": adam,
                "gather_fwd": GATHERED_ELEMENTS * F32, "gather_bwd": GATHERED_BWD_ELEMENTS * F32,
                "gather_recompute": 0,  # no recompute in this model
                # one fp32 wgrad buffer per padded shape, back in the pool after its reduce-scatter
                "wgrad_pool": GATHERED_ELEMENTS * F32, "fp8_shards": 0}
    measured = dict(report["bytes"])
    activations = measured.pop("activations")  # what forward kept: measured on CUDA only
    assert measured == expected, (measured, expected)
    assert activations is None if ctx.device.type == "cpu" else activations > 0
    phases = report["phases"]
    assert list(phases) == ["forward", "backward", "optimizer"]
    assert [p["calls"] for p in phases.values()] == [1, 1, 1]
    assert phases["forward"]["bytes"]["main_grad"] == 0 and phases["forward"]["bytes"]["optimizer"] == 0
    assert phases["forward"]["bytes"]["gather_bwd"] == 0  # backward gathers not yet issued
    assert phases["backward"]["bytes"]["main_grad"] == params and phases["backward"]["bytes"]["optimizer"] == 0
    assert phases["optimizer"]["bytes"]["optimizer"] == adam
    cpu = ctx.device.type == "cpu"
    for record in phases.values():  # no CUDA: no peak numbers, not zeros
        assert (record["peak_allocated"] is None) == cpu and (record["peak_reserved"] is None) == cpu
        assert (record["retained"] is None) == cpu
    assert report["peaks_measured"] is not cpu and report["device"] == str(ctx.device)
    assert (report["rank"], report["world_size"], report["iterations"]) == (ctx.rank, 2, 1)
    assert report["etp"]["runtimes"] == 1 and report["etp"]["stats"]["reduce_scatters"] == 2

    # FP8 gathers: one byte per gathered element, and one FP8 copy of each shard.
    fp8_report, _ = _train_one_step(ctx, base.replace(gather_dtype="fp8_tensorwise"))
    assert fp8_report["bytes"]["gather_fwd"] == GATHERED_ELEMENTS
    assert fp8_report["bytes"]["gather_bwd"] == GATHERED_BWD_ELEMENTS
    # one byte per shard element; on CUDA in the pool's aligned slots, as the shards above
    fp8_held = SHARD_ELEMENTS
    if ctx.device.type == "cuda":
        fp8_held = sum(-(-n // SLOT_ALIGN) * SLOT_ALIGN for n in (16 * 8, 4 * 30))
    assert fp8_report["bytes"]["fp8_shards"] == fp8_held, (fp8_report["bytes"], fp8_held)
    assert fp8_report["bytes"]["wgrad_pool"] == GATHERED_ELEMENTS * F32  # gradients stay fp32

    # The flag on: allocations at INFO, acquires / releases at DEBUG, on the etp.cache logger.
    _, records = _train_one_step(ctx, base.replace(debug_checks=True))
    messages = [(r.levelno, r.getMessage()) for r in records]
    allocations = [m for level, m in messages if level == logging.INFO and "allocated" in m]
    assert sum("etp cache:" in m for m in allocations) == 3  # 2 forward + 1 backward buffers
    assert sum("etp wgrad pool:" in m for m in allocations) == 2  # 2 shapes
    assert any(level == logging.DEBUG and "release" in m for level, m in messages)
    return report


def test_measured_categories_match_hand_counts():
    reports = run_distributed(_audit_ranks, 2)
    # The report survives JSON unchanged (ints, None, strings, nested dicts only).
    for report in reports:
        assert json.loads(json.dumps(report)) == report


def _local_audit():
    model = nn.Linear(4, 6)  # 24 + 6 fp32 elements
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    audit = MemoryAudit(model, opt)
    for _ in range(2):
        with audit.phase("forward"):
            loss = model(torch.ones(3, 4)).sum()
        with audit.phase("backward"):
            loss.backward()
        with audit.phase("optimizer"):
            opt.step()
        opt.zero_grad(set_to_none=True)
        audit.step_done()
    return audit


def test_report_schema_and_json_round_trip(tmp_path):
    audit = _local_audit()
    report = audit.write_json(tmp_path / "audit.json")
    assert json.loads((tmp_path / "audit.json").read_text()) == report
    assert report["schema_version"] == 1 and report["units"] == "bytes per rank"
    assert set(report) == {"schema_version", "units", "rank", "world_size", "device", "peaks_measured",
                           "iterations", "phases", "bytes", "etp"}
    assert report["etp"] is None and report["iterations"] == 2
    assert tuple(report["bytes"]) == CATEGORIES  # lines up with predict_memory by name
    for name, value in report["bytes"].items():
        assert value is None if name == "activations" else isinstance(value, int)
    for record in report["phases"].values():
        assert set(record) == {"calls", "peak_allocated", "peak_reserved", "retained", "bytes"}
        assert record["calls"] == 2
    # Repeated phases keep their maximum: grads were set to None after each step, yet the
    # backward phase end saw 30 fp32 elements of them; SGD momentum buffers after the step.
    assert report["phases"]["backward"]["bytes"]["main_grad"] == 30 * F32
    assert report["bytes"]["main_grad"] == 30 * F32
    assert report["bytes"]["optimizer"] == 30 * F32
    assert audit.measure()["main_grad"] == 0  # now: zeroed


def test_phase_errors_and_nesting():
    audit = MemoryAudit(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="phase name ''"), audit.phase(""):
        pass
    with pytest.raises(RuntimeError, match="boom"), audit.phase("forward"):
        raise RuntimeError("boom")
    assert audit.phases == {}  # a phase that raised recorded nothing
    with audit.phase("step"), audit.phase("forward"):
        pass
    assert {name: r.calls for name, r in audit.phases.items()} == {"forward": 1, "step": 1}
    with pytest.raises(TypeError, match="optimizer=str"):
        MemoryAudit(nn.Linear(2, 2), optimizer="adam")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda'.*CUDA is not available"):
            MemoryAudit(nn.Linear(2, 2), device="cuda")


def test_compare_arithmetic():
    audit = _local_audit()
    measured = audit.report()["bytes"]  # params 120, main_grad 120, optimizer 120, rest 0
    assert (measured["params"], measured["main_grad"], measured["optimizer"]) == (120, 120, 120)
    prediction = {"params": 100, "optimizer": 240, "gather_fwd": 0, "wgrad_pool": 0,
                  "activations": 7, "total": 12345}
    out = audit.compare(prediction)
    rows = out["categories"]
    assert list(rows) == ["params", "optimizer", "gather_fwd", "wgrad_pool", "activations"]
    assert rows["params"] == {"predicted": 100, "measured": 120, "error": 20, "rel_error": 0.2}
    assert rows["optimizer"] == {"predicted": 240, "measured": 120, "error": -120, "rel_error": -0.5}
    assert rows["gather_fwd"] == {"predicted": 0, "measured": 0, "error": 0, "rel_error": 0.0}
    # Not measured off CUDA: no error at all rather than a wrong one.
    assert rows["activations"] == {"predicted": 7, "measured": None, "error": None, "rel_error": None}
    # The total sums measured categories only: 100 + 240 predicted, 120 + 120 measured.
    assert out["total"] == {"predicted": 340, "measured": 240, "error": -100, "rel_error": -100 / 340,
                            "categories": ["params", "optimizer", "gather_fwd", "wgrad_pool"]}
    assert json.loads(json.dumps(out)) == out
    table = audit.format_table(prediction)
    assert "+20.0%" in table and "-50.0%" in table and "n/a" in table
    with pytest.raises(ValueError, match=r"unknown categories \['recipe'\]"):
        audit.compare({"recipe": "x.yaml", "params": 1})
    with pytest.raises(ValueError, match=r"prediction\['params'\]=-1"):
        audit.compare({"params": -1})
    with pytest.raises(TypeError, match="prediction=list"):
        audit.compare([("params", 1)])


def _megatron_style_optimizer(params):
    """A megatron-core ChainedOptimizer around a Float16OptimizerWithFloat16Params whose
    attributes are set as its __init__ sets them (that __init__ needs CUDA tensors): the fp32
    master copy of each bf16 param replaces it in the inner optimizer, fp32 params stay."""
    from megatron.core.optimizer import (
        ChainedOptimizer,
        Float16OptimizerWithFloat16Params,
    )

    bf16, fp32 = params
    master = bf16.detach().clone().float()
    inner = torch.optim.Adam([master, fp32], lr=1e-3)
    mixed = Float16OptimizerWithFloat16Params.__new__(Float16OptimizerWithFloat16Params)
    mixed.optimizer = inner
    mixed.float16_groups, mixed.fp32_from_float16_groups, mixed.fp32_from_fp32_groups = [[bf16]], [[master]], [[fp32]]
    return ChainedOptimizer([mixed]), master


def test_megatron_optimizer_counts_master_params_once():
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(10, 4, dtype=torch.bfloat16))  # 40 elements
    model.b = nn.Parameter(torch.zeros(6))  # fp32, stepped in place by megatron
    chained, master = _megatron_style_optimizer([model.w, model.b])
    audit = MemoryAudit(model, chained)
    assert audit.measure()["params"] == 40 * 2 + 6 * F32
    assert audit.measure()["optimizer"] == 40 * F32  # the master copy; model.b is a param
    master.grad, model.b.grad = torch.ones_like(master), torch.ones_like(model.b)
    chained.chained_optimizers[0].optimizer.step()
    # + Adam moments of master (40) and b (6), fp32, and a 0-dim fp32 step each.
    assert audit.measure()["optimizer"] == 40 * F32 + 2 * (40 + 6) * F32 + 2 * F32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="allocator peaks are measured on CUDA only")
def test_cuda_phase_peaks():
    device = torch.device("cuda")
    audit = MemoryAudit(nn.Linear(4, 4, device=device))
    mib = 2**20
    with audit.phase("step"):
        with audit.phase("forward"):
            kept = torch.empty(mib, dtype=torch.uint8, device=device)  # outlives the phase
            transient = torch.empty(8 * mib, dtype=torch.uint8, device=device)
            del transient
        with audit.phase("backward"):
            del kept
    report = audit.report()
    forward, backward, step = (report["phases"][n] for n in ("forward", "backward", "step"))
    assert forward["retained"] == mib and backward["retained"] == -mib
    assert report["bytes"]["activations"] == mib
    assert forward["peak_allocated"] >= 9 * mib and forward["peak_reserved"] >= forward["peak_allocated"]
    assert step["peak_allocated"] >= forward["peak_allocated"]  # the inner reset kept the outer peak
    assert backward["peak_allocated"] < forward["peak_allocated"]

    # A one-time allocation of the first iteration (like the cuBLAS workspace) is not an
    # activation: once a second iteration is marked, retained comes from the later ones.
    audit, warmup = MemoryAudit(nn.Linear(4, 4, device=device)), []
    for iteration in range(3):
        with audit.phase("forward"):
            if iteration == 0:
                warmup.append(torch.empty(4 * mib, dtype=torch.uint8, device=device))
            kept = torch.empty(mib, dtype=torch.uint8, device=device)
        with audit.phase("backward"):
            del kept
        audit.step_done()
        expected = 5 * mib if iteration == 0 else mib
        assert audit.report()["bytes"]["activations"] == expected, iteration


@pytest.mark.skipif(not torch.cuda.is_available(), reason="megatron's Float16Optimizer needs CUDA")
def test_real_megatron_float16_optimizer():
    from megatron.core.optimizer import (
        ChainedOptimizer,
        Float16OptimizerWithFloat16Params,
        OptimizerConfig,
    )

    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(10, 4, dtype=torch.bfloat16, device="cuda"))
    model.b = nn.Parameter(torch.zeros(6, device="cuda"))
    config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True)
    mixed = Float16OptimizerWithFloat16Params(torch.optim.Adam(model.parameters(), lr=1e-3), config, None,
                                              lambda opt: None)
    audit = MemoryAudit(model, ChainedOptimizer([mixed]))
    assert audit.measure()["optimizer"] == 40 * F32  # fp32 master of w only
