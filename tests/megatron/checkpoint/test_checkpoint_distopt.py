"""Checkpoints with megatron-core's DistributedOptimizer (etp.megatron.checkpoint), CPU ranks.

A 2-layer MoE GPTModel in bf16 (fp32 masters) with the real ``DistributedOptimizer`` over
ETP 2 x replicate 2 steps Adam twice (on gradients made up from the master weights, equal on
replicas and zero on padding rows, like real ones) and saves. The reference is megatron's
own gather of its flat buffers (``get_parameter_state_dp_zero``, sliced by the buffer's
``param_index_map``), then the test's own ETP all-gather: every full weight, fp32 master and
Adam moment at save time. The checkpoint then loads

* at ETP 4 without the distributed optimizer (bf16 weights, fp32 masters), which saves again,
* and that one at ETP 1 with the distributed optimizer over 4 ranks,

and each must hold those full tensors bit for bit (and step counts of 2).

megatron-core's DistributedOptimizer assumes CUDA in four places that do not matter here:
buffers on ``torch.cuda.current_device()``, ``param.type()`` compared with
``'torch.cuda.FloatTensor'`` names, a unit loss-scale tensor made on ``device='cuda'`` and
``.cuda()`` of the shards its state gather sends. ``_megatron_on_cpu`` redirects those four
inside the spawned ranks only.
"""
import pytest
import torch
import torch.distributed as dist
from test_checkpoint_train import (
    _full,
    _gpt,
    _mixed_precision,
    _mixed_precision_snapshot,
    shared_body,
)

pytest.importorskip("megatron.core")
KEYS = ("weight", "master", "exp_avg", "exp_avg_sq")


def _megatron_on_cpu() -> None:
    torch.cuda.current_device = lambda: "cpu"
    tensor_type, make_tensor = torch.Tensor.type, torch.tensor

    def cuda_type_name(self, *args, **kwargs):
        name = tensor_type(self, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs else name

    def tensor_on_cpu(*args, **kwargs):
        if str(kwargs.get("device")) == "cuda":
            kwargs["device"] = "cpu"
        return make_tensor(*args, **kwargs)

    torch.Tensor.type = cuda_type_name
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.tensor = tensor_on_cpu


def _distributed(etp_size: int):
    """(bare GPTModel, DDP, megatron-core's DistributedOptimizer) at ETP ``etp_size``, bf16:
    etp's DDP and optimizer builder, or at ETP 1 stock megatron-core's."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from etp.megatron.ddp import ETPDistributedDataParallel
    from etp.megatron.optimizer import get_etp_megatron_optimizer

    gpt, _ = _gpt(etp_size)
    gpt.config.bf16 = True
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, use_distributed_optimizer=True)
    if etp_size == 1:
        ddp = DistributedDataParallel(gpt.config, ddp_config, Float16Module(gpt.config, gpt))
        return gpt, ddp, get_megatron_optimizer(opt_config, [ddp], use_gloo_process_groups=False)
    ddp = ETPDistributedDataParallel(gpt.config, ddp_config, Float16Module(gpt.config, gpt))
    return gpt, ddp, get_etp_megatron_optimizer(opt_config, [ddp])


def _distributed_snapshot(gpt, optimizer) -> dict:
    """Full tensors from megatron's own gather of the distributed optimizer's flat buffers."""
    from etp.megatron.optimizer import inner_optimizers

    per_param = {}
    for opt in inner_optimizers(optimizer):
        world = opt.get_parameter_state_dp_zero(use_gloo_comm=False, return_on_all_ranks=True)
        for index, buffer in enumerate(opt.buffers):
            (tensors,) = world[index].values()
            for param, (start, end, _) in buffer.param_index_map.items():
                per_param[param] = {key: tensors[key][start:end].view(param.shape)
                                    for key in ("param", "exp_avg", "exp_avg_sq")}
    out = {}
    for name, param in gpt.named_parameters():
        state = per_param[param]
        out[name] = {"weight": _full(param, param.data), "master": _full(param, state["param"]),
                     "exp_avg": _full(param, state["exp_avg"]), "exp_avg_sq": _full(param, state["exp_avg_sq"])}
    return out


def _written_elements(model, optimizer) -> dict[str, tuple[int, int]]:
    """{checkpoint key: (elements its main replicas write, over all ranks; its global size)}
    for the optimizer state: each logical element must have exactly one writer (DCP would
    quietly drop an equal duplicate, so the files cannot show it)."""
    import math

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    from etp.megatron.checkpoint.optimizer_state import _optimizer_sharded_state, _param_states
    from etp.megatron.checkpoint.training import _etp_groups, _model_sharded_state_dict

    inner, model_sd = _model_sharded_state_dict(model)
    opt_sd, _ = _optimizer_sharded_state(model_sd, _param_states(optimizer), _etp_groups(inner))
    mine: dict[str, list[int]] = {}
    for box in nested_values(opt_sd):
        entry = mine.setdefault(box.key, [0, math.prod(box.global_shape)])
        entry[0] += box.data.numel() if is_main_replica(box.replica_id) else 0
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    total: dict[str, tuple[int, int]] = {}
    for counts in everyone:
        for key, (written, size) in counts.items():
            total[key] = (total.get(key, (0, size))[0] + written, size)
    return total


def _steps(optimizer) -> set[float]:
    from etp.megatron.optimizer import inner_optimizers

    mine = {float(s["step"]) for opt in inner_optimizers(optimizer) for s in opt.optimizer.state.values()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(mine))
    return {step for steps in everyone for step in steps}


def _assert_equal(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys()
    for name, tensors in want.items():
        for key in KEYS:
            a, b = got[name][key], tensors[key]
            assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: {name} {key} differs {a.dtype} {b.dtype} {(a.float()-b.float()).abs().max()} {a.flatten()[:4]} {b.flatten()[:4]}"


def _round_trips(ctx, root):
    from megatron.core import parallel_state as ps

    from etp.megatron.checkpoint import load_training_checkpoint, save_training_checkpoint
    from etp.megatron.optimizer import inner_optimizers

    _megatron_on_cpu()
    gpt, ddp, optimizer = _distributed(2)
    for _ in range(2):
        for opt in inner_optimizers(optimizer):
            for group in opt.optimizer.param_groups:
                for master in group["params"]:
                    master.grad = torch.sin(3 * master.detach())
            opt.optimizer.step()
            opt._copy_main_params_to_model_params()
        ddp.start_param_sync()  # the rest of each bucket from its owners, as megatron's step does
    expected = _distributed_snapshot(gpt, optimizer)
    assert all(expected[n]["exp_avg"].any() for n in expected), "every param must have stepped"
    written = _written_elements(ddp, optimizer)
    assert written and all(w == size for w, size in written.values()), written
    save_training_checkpoint(f"{root}/distributed", 2, ddp, optimizer)
    ps.destroy_model_parallel()

    gpt, opt = _mixed_precision(4)  # distributed -> not distributed, ETP 2 -> 4
    load_training_checkpoint(f"{root}/distributed", gpt, opt)
    _assert_equal(_mixed_precision_snapshot(gpt, opt), expected, "ETP 4 without the distributed optimizer")
    assert {float(s["step"]) for s in opt.optimizer.state.values()} == {2.0}
    save_training_checkpoint(f"{root}/plain", 2, gpt, opt)
    ps.destroy_model_parallel()

    gpt, ddp, optimizer = _distributed(1)  # not distributed -> distributed over 4, ETP 4 -> 1
    load_training_checkpoint(f"{root}/plain", ddp, optimizer)
    _assert_equal(_distributed_snapshot(gpt, optimizer), expected, "ETP 1 with the distributed optimizer")
    assert _steps(optimizer) == {2.0}
    ps.destroy_model_parallel()
    return True


def test_distributed_optimizer_state_reshards_both_ways(tmp_path_factory):
    # _round_trips runs in test_checkpoint_train's shared 4-rank spawn (one start-up less).
    assert shared_body(tmp_path_factory, "distributed_optimizer") == [True] * 4
