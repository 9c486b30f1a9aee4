"""etp-train's torch FSDP2 peer (recipe key ``use_torch_fsdp2``): what the recipe refuses beside it
(and beside ``use_megatron_fsdp``),
what ``auto`` resolves to, and a CPU run of the tiny recipe that trains like megatron-style DDP."""
import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from etp.recipe import Recipe, RecipeError  # noqa: E402
from etp.train.auto import Machine, resolve_auto  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_moe_cpu.yaml"
OLMOE = ROOT / "recipes" / "olmoe_1b_7b.yaml"
H100 = dict(cuda=True, gpu_name="NVIDIA H100 80GB HBM3", gpu_memory=80 * 2**30, sm90=True)

#: override -> the key the refusal names, for either FSDP peer (PP, CP and fp16, refused beside
#: anything: tests/recipe/test_recipe.py)
REFUSED_BESIDE_EITHER = [
    ({"etp": {"etp_size": 2}}, "etp.etp_size"),
    ({"etp": {"expert_etp_size": 2}}, "etp.expert_etp_size"),
    ({"cuda_graph": "step", "moe_token_dispatcher_type": "local", "bf16": True}, "cuda_graph"),
    ({"tensor_model_parallel_size": 2}, "tensor_model_parallel_size"),
    ({"expert_model_parallel_size": 2}, "expert_model_parallel_size"),
    ({"expert_tensor_parallel_size": 2}, "expert_tensor_parallel_size"),
    ({"save": "/tmp/etp_fsdp_ckpt"}, "save"),
    ({"load": "/tmp/etp_fsdp_ckpt"}, "load"),
    ({"moe_token_dispatcher_type": "etp"}, "moe_token_dispatcher_type"),
    ({"moe_token_dispatcher_type": "flex"}, "moe_token_dispatcher_type"),
]
REFUSED = ([("use_torch_fsdp2", *case) for case in REFUSED_BESIDE_EITHER]
           + [("use_megatron_fsdp", *case) for case in REFUSED_BESIDE_EITHER]
           + [("use_torch_fsdp2", {"use_distributed_optimizer": True}, "use_distributed_optimizer"),
              ("use_torch_fsdp2", {"overlap_param_gather": True, "use_distributed_optimizer": True,
                                   "overlap_grad_reduce": True}, "overlap_param_gather"),
              ("use_megatron_fsdp", {"use_torch_fsdp2": True}, "use_torch_fsdp2")])


@pytest.mark.parametrize("flag,override,key", REFUSED, ids=[f"{flag}-{key}" for flag, _, key in REFUSED])
def test_what_an_fsdp_peer_cannot_hold_is_refused_in_one_line_naming_the_key(flag, override, key):
    Recipe.from_yaml(TINY, **override, world_size=None)  # valid without the peer (on some number of ranks)
    with pytest.raises(RecipeError) as error:
        Recipe.from_yaml(TINY, **override, **{flag: True}, world_size=None)
    message = str(error.value)
    assert error.value.key == key and flag in message and "\n" not in message, message


def test_overlap_grad_reduce_is_turned_off_with_a_note():
    recipe = Recipe.from_yaml(OLMOE, use_torch_fsdp2=True, micro_batch_size=2)  # the recipe sets overlap_grad_reduce: true
    assert recipe.parallel.overlap_grad_reduce is False
    assert any(note.startswith("use_torch_fsdp2: overlap_grad_reduce turned off") for note in recipe.notes)
    assert Recipe.from_yaml(OLMOE).parallel.overlap_grad_reduce is True


def test_auto_resolves_etp_off_and_eager_with_the_reason():
    recipe, notes = resolve_auto(Recipe.from_yaml(OLMOE, use_torch_fsdp2=True, micro_batch_size=2), Machine(4, 4, **H100))
    assert (recipe.etp.etp_size, recipe.etp.expert_etp_size, recipe.train.cuda_graph) == (1, 1, "none")
    assert "etp.etp_size auto -> 1: use_torch_fsdp2 shards every weight" in notes[0]
    assert notes[2].startswith("cuda_graph auto -> none: this recipe cannot be captured") and "use_torch_fsdp2" in notes[2]
    etp, _ = resolve_auto(Recipe.from_yaml(OLMOE), Machine(4, 4, **H100))
    assert (etp.etp.etp_size, etp.train.cuda_graph) == (4, "step")  # without FSDP2 auto is unchanged


@pytest.mark.parametrize("args,says", [(["--set", "save=/tmp/etp_fsdp2_ckpt"], "recipe key save="),
                                       (["--audit", "/tmp/etp_fsdp2_audit.json"], "--audit does not model")])
def test_etp_train_refuses_before_starting(capsys, args, says):
    from etp.train.main import main

    code = main(["--recipe", str(TINY), "--set", "use_torch_fsdp2=true", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and says in err and "use_torch_fsdp2" in err, err


def _etp_train(tmp_path, name: str, *sets: str) -> tuple[dict, str]:
    """One etp-train run of the tiny CPU recipe (2 gloo ranks): its --json report and the ranks'
    stdout (the launcher's notes go to sys.stdout)."""
    from etp.train.main import main

    report, stdout = tmp_path / f"{name}.json", tmp_path / f"{name}.txt"
    argv = ["--recipe", str(TINY), "--train-iters", "8", "--log-interval", "1", "--json", str(report)]
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(stdout, "w") as f:
            os.dup2(f.fileno(), 1)  # the spawned ranks write to file descriptor 1
            code = main(argv + [item for value in sets for item in ("--set", value)])
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    assert code == 0, stdout.read_text()
    return json.loads(report.read_text()), stdout.read_text()


@pytest.mark.slow  # the benchmark peer's full CPU run (etp's own runs are default); its refusals and auto choices are default
def test_fsdp2_run_trains_like_ddp_without_etp(tmp_path, capsys):
    """Per iteration, loss and gradient norm of the FSDP2 run equal the DDP run's (TorchStep:
    ETP off, gradients all-reduced and averaged over the 2 data-parallel ranks, torch AdamW).

    Both train in fp32 on the same batches from the same initialization; what differs is only the
    order of floating-point sums (FSDP2's reduce-scatter against the all-reduce, the norm over
    shards against the norm over whole tensors), about one fp32 ulp (1.2e-7 relative) per sum:
    over 8 Adam steps the two stay within 1e-6 of each other here, so rtol 1e-5 leaves a margin
    of ten while an unaveraged gradient (norm x 2) or an unreduced one (each rank steps on its own
    half of the batch, losses apart by 1e-3 after two steps) fails. Both decay the weights as
    megatron-core does (``etp.train.optimizer_steps.weight_decay_groups``).
    """
    ddp, _ = _etp_train(tmp_path, "ddp", "etp.etp_size=1", "etp.expert_etp_size=1")
    capsys.readouterr()
    fsdp2, out = _etp_train(tmp_path, "fsdp2", "use_torch_fsdp2=true")  # ETP sizes auto
    assert ddp["stepper"] == "TorchStep" and fsdp2["stepper"] == "FSDP2Step"
    assert "etp.etp_size auto -> 1: use_torch_fsdp2" in capsys.readouterr().out  # the launcher's notes
    assert "torch FSDP2 over the data-parallel ranks" in out  # rank 0's
    assert len(fsdp2["losses"]) == 8 and fsdp2["losses"][-1] < fsdp2["losses"][0]
    assert fsdp2["losses"] == pytest.approx(ddp["losses"], rel=1e-5)
    norms = [[record["grad_norm"] for record in report["log"]] for report in (ddp, fsdp2)]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)
    assert fsdp2["tflops_per_rank"] > 0 and fsdp2["flops_per_iter_per_rank"] == ddp["flops_per_iter_per_rank"]
    assert fsdp2["predicted_peak_gib"] is None and isinstance(fsdp2["param_bits_sum"], int)
