"""Training checkpoints (etp.megatron.checkpoint) on CPU ranks (gloo).

* Reshard: the tiny recipe's megatron-core GPTModel (etp grouped experts; shapes chosen so that
  shards are padded and straddle experts) trains 2 steps with AdamW at one layout and saves
  (at TP = 2, where megatron-core's MoE layer refuses to train without sequence parallelism,
  which its torch norms refuse, Adam steps on made-up gradients);
  every parameter's full weight and full Adam moments are gathered *at save time* by the test
  itself (all-gather of shards, TP concat). Fresh models at other layouts load the
  checkpoint and their gathered full tensors must equal those bit for bit.
* Resume: ``etp-train`` for 10 of 20 iterations with a save, then ``--resume``: the losses of
  iterations 11-20 equal the uninterrupted run's.
"""
import contextlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed

from etp.train.batches import Batches
from etp.train.model_build import build_model

pytest.importorskip("megatron.core")
ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "recipes" / "tiny_moe_cpu.yaml"
SHAPES = dict(hidden_size=48, moe_ffn_hidden_size=36, micro_batch_size=2, seq_length=32,
              max_position_embeddings=32, train_iters=4, lr_warmup_iters=1, world_size=4)


def _recipe(tp: int, etp: int, eetp: int):
    from etp.recipe import Recipe

    return Recipe.from_yaml(TINY, **SHAPES, tensor_model_parallel_size=tp, expert_tensor_parallel_size=1,
                            global_batch_size=2 * 4 // tp,
                            etp={"etp_size": etp, "expert_etp_size": eetp, "pad_for_alignment": 16})


def _full(param, tensor):
    """The full logical tensor of ``tensor`` (``param``'s shard shape) on every rank."""
    from megatron.core import parallel_state as ps

    from etp import ETPShardedParam

    if isinstance(param, ETPShardedParam):
        layout = param.etp_layout
        pieces = [torch.empty_like(tensor) for _ in range(param.etp_group.size)]
        dist.all_gather(pieces, tensor.contiguous(), group=param.etp_group.ag_group)
        tensor = torch.cat(pieces)[: layout.rows].reshape(param.logical_shape)
    if getattr(param, "tensor_model_parallel", False) and ps.get_tensor_model_parallel_world_size() > 1:
        pieces = [torch.empty_like(tensor) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(pieces, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
        tensor = torch.cat(pieces, dim=param.partition_dim)
    return tensor.clone()


def _snapshot(model, optimizer):
    out = {}
    for name, param in model.named_parameters():
        state = optimizer.state[param]
        out[name] = {"weight": _full(param, param.data)}
        for key in ("exp_avg", "exp_avg_sq"):
            out[name][key] = _full(param, state[key])
    return out


def _build(recipe):
    from megatron.core import parallel_state as ps

    from etp.megatron.groups import build_megatron_etp_groups
    from etp.megatron.model import apply_etp
    from etp.train.optimizer_steps import TorchStep

    ps.initialize_model_parallel(tensor_model_parallel_size=recipe.parallel.tensor_model_parallel_size,
                                 expert_tensor_parallel_size=recipe.parallel.expert_tensor_parallel_size)
    groups = build_megatron_etp_groups(recipe.etp)
    model, loss_fn, _ = build_model(recipe, torch.device("cpu"))
    apply_etp(model, recipe.etp, groups)
    trainer = TorchStep(recipe, model, groups, ps.get_tensor_model_parallel_group())
    return model, loss_fn, trainer


def _save_then_load(ctx, root, saved_layout, load_layouts):
    from megatron.core import parallel_state as ps

    from etp.megatron.checkpoint import load_training_checkpoint, save_training_checkpoint

    recipe = _recipe(*saved_layout)
    model, loss_fn, trainer = _build(recipe)
    batches = Batches(recipe, ps.get_data_parallel_rank(), torch.device("cpu"), recipe.num_microbatches(4))
    for iteration in range(2):
        if saved_layout[0] == 1:
            for index, _context in enumerate(trainer.microbatches(recipe.num_microbatches(4))):
                loss, objective = loss_fn(model, batches.get(iteration, index))
                objective.backward()
            trainer.step(recipe.train.lr, lambda name: contextlib.nullcontext())
        else:  # megatron's TP output gather needs CUDA: Adam steps on gradients made up from the
            # weights (equal on replicas, zero on padding rows like real ones)
            for param in model.parameters():
                param.grad = torch.sin(3 * param.detach())
            trainer.optimizer.step()
    expected = _snapshot(model, trainer.optimizer)
    save_training_checkpoint(root, 2, model, trainer.optimizer, {"layout": list(saved_layout)})
    ps.destroy_model_parallel()

    for layout in load_layouts:
        model, _, trainer = _build(_recipe(*layout))
        iteration, metadata, _ = load_training_checkpoint(root, model, trainer.optimizer)
        assert iteration == 2 and metadata["layout"] == list(saved_layout)
        got = _snapshot(model, trainer.optimizer)
        for name, tensors in expected.items():
            for key, want in tensors.items():
                assert torch.equal(got[name][key], want), f"{layout}: {name} {key} differs"
        for param in model.parameters():  # padding rows stay zero
            if hasattr(param, "etp_layout"):
                valid = param.etp_layout.valid_rows
                assert not param.data[valid:].any() and not trainer.optimizer.state[param]["exp_avg"][valid:].any()
        steps = {float(s["step"]) for s in trainer.optimizer.state.values()}
        assert steps == {2.0}, steps
        ps.destroy_model_parallel()
    return True


# (TP, ETP, expert ETP) saved, then loaded at each of these layouts; runs in the shared spawn
# (the end of this module).
RESHARD = ((1, 4, 4), [(1, 2, 2), (1, 1, 1), (1, 4, 4), (1, 2, 4)])
RESHARD_TP2 = ((2, 2, 2), [(1, 4, 4), (1, 1, 1)])  # a TP change too


@pytest.mark.parametrize("body", ["reshard", "reshard_tp2"], ids=["etp4-to-2-1-4", "tp2xetp2-to-tp1xetp4"])
def test_reshard_weights_and_adam_moments_bit_exact(request, body):
    assert shared_body(request.getfixturevalue("tmp_path_factory"), body) == [True] * 4


# The same floats after a resume: also test_no_lost_work's killed-rank test (a SIGKILL in place of
# --exit-after), which runs by default.
@pytest.mark.slow
def test_resume_continues_the_loss_curve(tmp_path):
    from etp.train.main import main

    base = ["--recipe", str(TINY), "--train-iters", "8", "--log-interval", "2"]
    save = ["--set", f"save={tmp_path / 'ckpt'}", "--set", "save_interval=4"]
    assert main([*base, "--json", str(tmp_path / "full.json")]) == 0
    assert main([*base, *save, "--exit-after", "4", "--json", str(tmp_path / "first.json")]) == 0
    assert main([*base, *save, "--resume", "--json", str(tmp_path / "resumed.json")]) == 0
    full, first, resumed = (json.loads((tmp_path / f"{n}.json").read_text())["losses"]
                            for n in ("full", "first", "resumed"))
    assert first == full[:4]
    assert resumed == full[4:]  # same data, same state: the same floats
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["iter_0000004", "iter_0000008", "latest"]


@pytest.mark.slow  # the reshard itself is bit-exact in test_reshard_weights_and_adam_moments_bit_exact
def test_resume_at_another_layout_continues_the_loss_curve(tmp_path):
    """Saved at 2 ranks x ETP 2, resumed at 4 ranks x ETP 4 (the global batch is the same
    samples at any layout): the losses continue the 2-rank run's within fp32 reduction-order
    noise."""
    from etp.train.main import main

    base = ["--recipe", str(TINY), "--train-iters", "14", "--log-interval", "7",
            "--set", "micro_batch_size=2", "--set", f"save={tmp_path / 'ckpt'}", "--set", "save_interval=7"]
    assert main([*base, "--json", str(tmp_path / "two.json")]) == 0
    four = ["--set", "world_size=4", "--set", "etp.etp_size=4", "--set", "etp.expert_etp_size=4",
            "--set", f"load={tmp_path / 'ckpt'}", "--set", f"save={tmp_path / 'ckpt4'}"]
    assert main([*base, *four, "--resume", "7", "--json", str(tmp_path / "four.json")]) == 0
    two, resumed = (json.loads((tmp_path / f"{n}.json").read_text())["losses"] for n in ("two", "four"))
    assert len(resumed) == 7
    assert torch.allclose(torch.tensor(resumed), torch.tensor(two[7:]), rtol=1e-4), (resumed, two[7:])


def _gpt(etp_size: int):
    """A 2-layer megatron-core GPTModel (MoE, etp grouped experts) at ETP ``etp_size`` with
    AdamW: megatron stacks its layers under one checkpoint key per weight."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from etp import ETPConfig
    from etp.megatron.groups import build_megatron_etp_groups
    from etp.megatron.model import apply_etp, etp_gpt_layer_spec

    ps.initialize_model_parallel()
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=96,
                               num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=36,
                               use_cpu_initialization=True, gated_linear_unit=True, add_bias_linear=False,
                               moe_token_dispatcher_type="allgather", activation_func=F.silu,
                               normalization="RMSNorm")
    model = GPTModel(config=config, transformer_layer_spec=etp_gpt_layer_spec(num_experts=4, normalization="RMSNorm"),
                     vocab_size=128, max_sequence_length=32, share_embeddings_and_output_weights=False)
    etp = ETPConfig(etp_size=etp_size, expert_etp_size=etp_size)
    apply_etp(model, etp, build_megatron_etp_groups(etp))
    return model, torch.optim.AdamW(model.parameters())


def _gpt_round_trip(ctx, root):
    from megatron.core import parallel_state as ps

    from etp.megatron.checkpoint import load_training_checkpoint, save_training_checkpoint

    model, optimizer = _gpt(4)
    for _ in range(2):  # Adam state from made-up gradients (zero on padding rows)
        for param in model.parameters():
            param.grad = torch.sin(3 * param.detach())
        optimizer.step()
    expected = _snapshot(model, optimizer)
    save_training_checkpoint(root, 2, model, optimizer)
    ps.destroy_model_parallel()
    for size in (2, 1):
        model, optimizer = _gpt(size)
        load_training_checkpoint(root, model, optimizer)
        got = _snapshot(model, optimizer)
        for name, tensors in expected.items():
            for key, want in tensors.items():
                assert torch.equal(got[name][key], want), f"ETP {size}: {name} {key} differs"
        ps.destroy_model_parallel()
    return True


def test_gpt_model_layers_stacked_under_one_key_round_trip(tmp_path_factory):
    assert shared_body(tmp_path_factory, "gpt") == [True] * 4


def _broken_description(ctx):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from etp.megatron.checkpoint.training import _validate_on_every_rank

    # Rank 1 describes half of a 2-row tensor, nobody the other half (ranks 0, 2, 3 nothing):
    # megatron's validation fails on rank 0 only; every rank must raise instead of waiting in
    # the save.
    piece = ShardedTensor.from_rank_offsets("w", torch.zeros(1, 4), (0, 1, 2), replica_id=0)
    for loading in (False, True):
        with pytest.raises(ValueError, match="sharding is invalid"):
            _validate_on_every_rank({"w": piece} if ctx.rank == 1 else {}, loading=loading)
    return True


def test_invalid_sharding_fails_on_every_rank(tmp_path_factory):
    assert shared_body(tmp_path_factory, "invalid") == [True] * 4


class _MixedPrecisionOptimizer:
    """The layout of megatron-core's Float16OptimizerWithFloat16Params (which needs CUDA):
    bf16 model params, fp32 master copies stepped by an inner torch optimizer."""

    def __init__(self, model):
        self.float16_groups = [list(model.parameters())]
        self.fp32_from_float16_groups = [[p.detach().float().clone().requires_grad_(True)
                                          for p in self.float16_groups[0]]]
        self.fp32_from_fp32_groups = [[]]
        self.optimizer = torch.optim.AdamW(self.fp32_from_float16_groups[0])


def _mixed_precision(etp_size: int):
    """The 2-layer GPTModel in bf16 with fp32 masters (megatron's mixed-precision layout)."""
    model, _ = _gpt(etp_size)
    model.to(torch.bfloat16)
    return model, _MixedPrecisionOptimizer(model)


def _mixed_precision_snapshot(model, opt) -> dict:
    """Full weight, fp32 master and Adam moments of every parameter, gathered by the test."""
    out = {}
    for (name, param), master in zip(model.named_parameters(), opt.fp32_from_float16_groups[0]):
        state = opt.optimizer.state[master]
        out[name] = {k: _full(param, t) for k, t in
                     (("weight", param.data), ("master", master.data),
                      ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"]))}
    return out


def _mixed_precision_round_trip(ctx, root):
    from megatron.core import parallel_state as ps

    from etp.megatron.checkpoint import load_training_checkpoint, save_training_checkpoint

    model, opt = _mixed_precision(4)
    for _ in range(2):
        for _param, master in zip(opt.float16_groups[0], opt.fp32_from_float16_groups[0]):
            master.grad = torch.sin(3 * master.detach())
        opt.optimizer.step()
        with torch.no_grad():
            for param, master in zip(opt.float16_groups[0], opt.fp32_from_float16_groups[0]):
                param.copy_(master)
    expected = _mixed_precision_snapshot(model, opt)
    save_training_checkpoint(root, 2, model, opt)
    ps.destroy_model_parallel()
    model, opt = _mixed_precision(2)
    load_training_checkpoint(root, model, opt)
    got = _mixed_precision_snapshot(model, opt)
    for name, tensors in expected.items():
        for key, want in tensors.items():
            assert got[name][key].dtype == want.dtype and torch.equal(got[name][key], want), (name, key)
    ps.destroy_model_parallel()
    return True


def test_mixed_precision_masters_round_trip(tmp_path_factory):
    """bf16 weights, fp32 masters and moments saved at ETP 4, loaded at ETP 2 bit for bit."""
    assert shared_body(tmp_path_factory, "mixed") == [True] * 4


# ------------------------------------------------------------------------------------------
# The 4-rank checkpoint bodies of this module, test_checkpoint_model and
# test_checkpoint_distopt share one spawn: starting 4 ranks with megatron-core costs ~14 s
# here, more than most bodies. Each body sets up and destroys its own model-parallel state
# and writes under its own directory. A rank that raises fails the spawn with its traceback
# (which names the body); the tests of bodies that had finished on every rank still pass, the
# others report that traceback.

# In this order: the cheap check first; the distributed optimizer's body last (it points
# torch's CUDA defaults at the CPU for the rest of the process).
SHARED_BODIES = ("invalid", "reshard", "reshard_tp2", "gpt", "mixed", "model_layouts", "distributed_optimizer")
_shared_outcome: dict = {}  # filled by the first test that asks, in whichever module


def _four_rank_bodies(ctx, root):
    from test_checkpoint_distopt import _round_trips
    from test_checkpoint_model import _tp1_layouts

    bodies = {"invalid": lambda: _broken_description(ctx),
              "reshard": lambda: _save_then_load(ctx, f"{root}/reshard", *RESHARD),
              "reshard_tp2": lambda: _save_then_load(ctx, f"{root}/reshard_tp2", *RESHARD_TP2),
              "gpt": lambda: _gpt_round_trip(ctx, f"{root}/gpt"),
              "mixed": lambda: _mixed_precision_round_trip(ctx, f"{root}/mixed"),
              "model_layouts": lambda: _tp1_layouts(ctx, f"{root}/model_layouts"),
              "distributed_optimizer": lambda: _round_trips(ctx, f"{root}/distributed_optimizer")}
    results = {}
    for name in SHARED_BODIES:
        results[name] = bodies[name]()
        (Path(root) / f"{name}.done{ctx.rank}").write_text(json.dumps(results[name]))
    return results


def _run_shared_bodies(root: Path) -> dict:
    """{body: per-rank results}; a failed spawn's message for the bodies that did not finish
    on every rank."""
    for name in ("model_layouts", "distributed_optimizer"):  # these two write into an existing directory
        (root / name).mkdir()
    try:
        results = run_distributed(_four_rank_bodies, 4, str(root), timeout=400)
    except AssertionError as exc:
        finished = {}
        for name in SHARED_BODIES:
            files = [root / f"{name}.done{rank}" for rank in range(4)]
            finished[name] = ([json.loads(f.read_text()) for f in files] if all(f.exists() for f in files)
                              else f"the shared 4-rank spawn failed before this body finished:\n{exc}")
        return finished
    return {name: [r[name] for r in results] for name in SHARED_BODIES}


def shared_body(tmp_path_factory, name: str) -> list:
    """The per-rank results of body ``name`` in the shared 4-rank spawn (run once per session,
    on first use)."""
    if not _shared_outcome:
        _shared_outcome.update(_run_shared_bodies(tmp_path_factory.mktemp("ckpt_shared")))
    outcome = _shared_outcome[name]
    if isinstance(outcome, str):
        pytest.fail(outcome, pytrace=False)
    return outcome
