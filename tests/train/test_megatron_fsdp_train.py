"""etp-train's Megatron-FSDP peer (recipe key ``use_megatron_fsdp``) without a GPU: what the recipe
refuses beside it and turns on for it, what ``auto`` resolves to, what etp-train refuses before any
rank starts, and the pieces of ``MegatronFSDPStep`` that need no CUDA. Its training runs on GPUs:
``tests/train/test_megatron_fsdp_gpu.py``."""
import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from etp.recipe import ParallelSpec, Recipe, RecipeError  # noqa: E402
from etp.train.auto import Machine, resolve_auto  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_moe_cpu.yaml"
OLMOE = ROOT / "recipes" / "olmoe_1b_7b.yaml"
H100 = dict(cuda=True, gpu_name="NVIDIA H100 80GB HBM3", gpu_memory=80 * 2**30, sm90=True)

# What the recipe refuses beside use_megatron_fsdp: tests/train/test_fsdp2_train.py, with FSDP2's.


def test_the_distributed_optimizer_and_both_overlaps_are_turned_on_with_a_note():
    recipe = Recipe.from_yaml(OLMOE, micro_batch_size=2, use_megatron_fsdp=True)  # the recipe: overlap_grad_reduce only
    p = recipe.parallel
    assert (p.use_distributed_optimizer, p.overlap_grad_reduce, p.overlap_param_gather) == (True, True, True)
    assert recipe.notes == ("use_megatron_fsdp: use_distributed_optimizer, overlap_param_gather turned on "
                            "(Megatron-FSDP's optim_grads_params steps its shards with megatron-core's distributed "
                            "optimizer and overlaps its gathers and reduce-scatters with compute)",)
    assert Recipe.from_yaml(OLMOE, micro_batch_size=2, use_megatron_fsdp=True, overlap_grad_reduce=False).parallel.overlap_grad_reduce
    with pytest.raises(RecipeError) as error:  # built directly, nothing turns them on
        ParallelSpec(use_megatron_fsdp=True)
    assert error.value.key == "use_distributed_optimizer" and "must be true with use_megatron_fsdp" in str(error.value)


def test_auto_resolves_etp_off_and_eager_with_the_reason():
    recipe, notes = resolve_auto(Recipe.from_yaml(OLMOE, micro_batch_size=2, use_megatron_fsdp=True), Machine(4, 4, **H100))
    assert (recipe.etp.etp_size, recipe.etp.expert_etp_size, recipe.train.cuda_graph) == (1, 1, "none")
    assert "etp.etp_size auto -> 1: use_megatron_fsdp shards every weight" in notes[0]
    assert notes[2].startswith("cuda_graph auto -> none: this recipe cannot be captured") and "use_megatron_fsdp" in notes[2]


@pytest.mark.parametrize("args,says", [
    (["--set", "save=/tmp/etp_megatron_fsdp_ckpt"], "recipe key save="),
    (["--audit", "/tmp/etp_megatron_fsdp_audit.json"], "--audit does not model use_megatron_fsdp"),
    ([], "use_megatron_fsdp needs backend nccl"),  # the tiny recipe's gloo
], ids=["save", "audit", "gloo"])
def test_etp_train_refuses_before_starting(capsys, args, says):
    from etp.train.main import main

    code = main(["--recipe", str(TINY), "--set", "use_megatron_fsdp=true", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and says in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs it (under torchrun)")
def test_etp_train_refuses_a_cpu_run(capsys):
    from etp.train.main import main

    code = main(["--recipe", str(TINY), "--set", "use_megatron_fsdp=true", "--set", "backend=auto"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert err == ("etp-train: error: use_megatron_fsdp needs CUDA GPUs (megatron-core's Megatron-FSDP allocates "
                   "CUDA streams and buffers): run it under torchrun on GPUs, or use use_torch_fsdp2 on CPU")


def test_preflight_names_what_the_gpu_machine_lacks(monkeypatch):
    """A GPU machine as this one would be: no einops, then CUDA_DEVICE_MAX_CONNECTIONS=1, then fine."""
    from etp.train import RunOptions, TrainError
    from etp.train.preflight import preflight

    recipe = Recipe.from_yaml(OLMOE, micro_batch_size=2, use_megatron_fsdp=True, etp={"etp_size": 1, "expert_etp_size": 1})
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "einops" else real_find_spec(name, *a))
    with pytest.raises(TrainError, match=r"^use_megatron_fsdp needs the einops package .*: pip install einops$"):
        preflight(recipe, RunOptions())
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "einops" else real_find_spec(name, *a))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(TrainError, match=r"^use_megatron_fsdp with CUDA_DEVICE_MAX_CONNECTIONS=1 .*: unset"):
        preflight(recipe, RunOptions())
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    assert preflight(recipe, RunOptions()) == []


def test_the_step_refuses_what_megatron_fsdp_cannot_wrap(monkeypatch):
    from etp.train.baselines import megatron_fsdp as megatron_fsdp_step

    recipe = Recipe.from_yaml(TINY, use_megatron_fsdp=True, backend="nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^use_megatron_fsdp needs CUDA GPUs"):
        megatron_fsdp_step.MegatronFSDPStep(recipe, torch.nn.Linear(2, 2), None)
    monkeypatch.setattr(megatron_fsdp_step, "unmet_requirement", lambda: None)
    with pytest.raises(ValueError, match=r"^MegatronFSDPStep needs megatron-core's GPTModel on a CUDA device"):
        megatron_fsdp_step.MegatronFSDPStep(recipe, torch.nn.Linear(2, 2), None)


def test_buckets_outside_the_layers_default_to_megatron_lms_size():
    from etp.train.baselines.megatron_fsdp import megatron_fsdp_bucket_size

    recipe = Recipe.from_yaml(TINY, use_megatron_fsdp=True)
    assert megatron_fsdp_bucket_size(recipe, 4) == 40_000_000
    assert megatron_fsdp_bucket_size(recipe, 64) == 64_000_000
    assert megatron_fsdp_bucket_size(recipe.replace(ddp_bucket_size=1000), 4) == 1000


def test_param_bits_sum_reads_a_list_of_shards_as_a_module():
    """etp-train reports Megatron-FSDP's fp32 shards (``MegatronFSDPStep.master_weights()``), a list."""
    from etp.train.reporting import param_bits_sum

    module = torch.nn.Linear(3, 5)
    assert param_bits_sum(list(module.parameters())) == param_bits_sum(module) != 0
