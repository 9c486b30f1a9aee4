"""A gather format added in one file (``int8_rowwise.py`` beside this test, named by its import
path) trains through ``etp.wrap_module_params_etp`` like an unsharded float64 reference that
applies the same int8 round-trip to its weights, moves one byte per weight element, quantizes
once per optimizer step, and trains through ``etp-train`` on gloo ranks, which resolve it
themselves (the audit measures its quantized shards in every rank)."""
import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from int8_rowwise import Int8Rowwise
from parity import TinyMoE

from etp import ETPConfig, ETPShardedParam, build_etp_groups, finalize_grads, wrap_module_params_etp

ROOT = Path(__file__).resolve().parents[2]
INT8 = "int8_rowwise:Int8Rowwise"
STEPS = 8


def _round_trip(w: torch.Tensor) -> torch.Tensor:
    """The int8 round-trip, written apart from the format: per row of the weight seen as
    ``[rows, cols]``, ``q = round(w * 127 / amax)`` and back to ``q / (127 / amax)``, float64."""
    rows = w.reshape(-1, w.shape[-1])
    amax = rows.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, 127 / amax, torch.ones_like(amax))
    return ((rows * scale).round().clamp(-127, 127) / scale).view_as(w)


def _train(ctx):
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, gather_dtype=INT8)
    torch.manual_seed(7)
    reference = TinyMoE()  # float64; its 3-row output layer's padding spills over ranks
    model = copy.deepcopy(reference)
    groups = build_etp_groups(config)
    wrap_module_params_etp(model, config, groups)
    sharded = {n for n, p in model.named_parameters() if isinstance(p, ETPShardedParam)}
    assert sharded, "nothing was sharded"
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, reference))
    counts = torch.tensor([5, 0, 9, 2])
    import etp.collectives as collectives

    moved, original_gather = [], collectives.all_gather_tensor

    def recording(out, inp, group=None, async_op=False):
        moved.append((inp.numel(), inp.numel() * inp.element_size()))
        return original_gather(out, inp, group=group, async_op=async_op)

    quantizations, original_quantize = [], Int8Rowwise.quantize
    Int8Rowwise.quantize = lambda self, *a: (quantizations.append(1), original_quantize(self, *a))[1]
    collectives.all_gather_tensor = recording
    losses, reference_losses, float_losses = [], [], []
    try:
        batches = []  # each rank's batch, the same every step: the loss must fall
        for r in range(ctx.world_size):
            gen = torch.Generator().manual_seed(100 + r)
            batches.append((torch.randn(16, 16, generator=gen, dtype=torch.float64),
                            torch.randn(16, 3, generator=gen, dtype=torch.float64)))
        for _ in range(STEPS):
            # The reference sees every rank's batch, with each sharded weight round-tripped
            # (its gradient passed straight through, as the sharded weight's is).
            weights = {n: (p + (_round_trip(p) - p).detach()) if n in sharded else p
                       for n, p in reference.named_parameters()}
            ref_opt.zero_grad()
            ref = torch.stack([F.mse_loss(torch.func.functional_call(reference, weights, (x, counts)), t)
                               for x, t in batches])
            ref.mean().backward()
            with torch.no_grad():  # the same weights without the round-trip: int8 is not a no-op
                float_losses.append(torch.stack([F.mse_loss(reference(x, counts), t) for x, t in batches]).mean())
            ref_opt.step()
            reference_losses.append(ref.mean().item())

            opt.zero_grad()
            x, target = batches[ctx.rank]
            loss = F.mse_loss(model(x, counts), target)
            loss.backward()
            finalize_grads(model, config, groups)
            opt.step()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / ctx.world_size)
    finally:
        Int8Rowwise.quantize = original_quantize
        collectives.all_gather_tensor = original_gather
    shard_elements = {p.numel() for p in model.parameters() if isinstance(p, ETPShardedParam)}
    wire = [(numel, nbytes) for numel, nbytes in moved if numel in shard_elements]
    errors = {}
    reference_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        got = p.full_tensor() if isinstance(p, ETPShardedParam) else p.detach()
        errors[name] = ((got - reference_params[name].detach()).abs().max() /
                        reference_params[name].detach().abs().max()).item()
    return dict(losses=losses, reference_losses=reference_losses, float_losses=[v.item() for v in float_losses],
                quantizations=len(quantizations), wire=wire, errors=errors)


def test_int8_rowwise_trains_like_its_round_tripped_reference():
    result = run_distributed(_train, 2)[0]
    # float64 throughout: the sharded run and the reference agree to rounding, step by step.
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(result["reference_losses"]),
                               rtol=1e-9, atol=0)
    assert max(result["errors"].values()) < 1e-9, result["errors"]
    # ... and the round-trip is not a no-op: the unquantized weights give another loss.
    first_gap = abs(result["reference_losses"][0] - result["float_losses"][0])
    assert first_gap > 1e-6 * result["float_losses"][0], first_gap
    assert result["losses"][-1] < result["losses"][0]
    assert result["quantizations"] == STEPS  # once per optimizer step
    assert result["wire"] and all(nbytes == numel for numel, nbytes in result["wire"])  # one byte per element


@pytest.fixture(scope="module")
def etp_train_run(tmp_path_factory):
    """etp-train on the CPU recipe with int8 gathers: (exit status, --json report, --audit report)."""
    from etp.train.main import main

    tmp = tmp_path_factory.mktemp("int8")
    code = main(["--recipe", str(ROOT / "recipes" / "tiny_moe_cpu.yaml"), "--train-iters", "8", "--log-interval", "2",
                 "--set", f"etp.gather_dtype={INT8}", "--json", str(tmp / "run.json"),
                 "--audit", str(tmp / "audit.json")])
    read = (lambda name: json.loads((tmp / name).read_text())) if code == 0 else (lambda name: None)
    return code, read("run.json"), read("audit.json")


def test_int8_rowwise_trains_through_etp_train(etp_train_run):
    code, run, audit = etp_train_run
    assert code == 0
    assert run["etp"]["gather_dtype"] == INT8 and run["etp"]["etp_size"] == 2
    losses = run["losses"]
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    # Every spawned rank resolved the format and kept its int8 shards: one byte per element,
    # as the memory audit predicts from the format object.
    for rank in audit["ranks"]:
        shards = rank["comparison"]["categories"]["fp8_shards"]
        assert shards["measured"] > 0 and shards["measured"] == shards["predicted"], shards
