"""ETP / EETP groups inside megatron-core's data-parallel groups for several (TP, CP, EP, ETP)
layouts on 4 gloo ranks: hand-computed tables for the simple layouts, invariants for all."""
import pytest
import torch.distributed as dist
from harness import run_distributed

pytest.importorskip("megatron.core")


def _layout(ctx, tp, cp, ep, etp, eetp):
    from megatron.core import parallel_state as ps

    from etp import ETPConfig
    from etp.megatron.groups import build_megatron_etp_groups

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 expert_model_parallel_size=ep)
    try:
        groups = build_megatron_etp_groups(ETPConfig(etp_size=etp, expert_etp_size=eetp))

        def ranks(group):
            return tuple(dist.get_process_group_ranks(group)) if group is not None else (ctx.rank,)

        me = ctx.rank
        tp_g = ranks(ps.get_tensor_model_parallel_group())
        dp_g = ranks(ps.get_data_parallel_group())
        dpcp_g = ranks(ps.get_data_parallel_group(with_context_parallel=True))
        edp_g = ranks(ps.get_expert_data_parallel_group())
        dense, expert = groups.dense.ranks, groups.expert.ranks
        repl, erepl = ranks(groups.dense_replicate), ranks(groups.expert_replicate)
        # Invariants: ETP is a contiguous chunk of the data-parallel group, orthogonal to TP;
        # the replicate group completes it within DP x CP.
        assert len(dense) == etp and set(dense) <= set(dp_g) and set(dense) & set(tp_g) == {me}
        i = dp_g.index(me)
        assert dense == dp_g[i - i % etp : i - i % etp + etp]
        assert set(repl) <= set(dpcp_g) and set(repl) & set(dense) == {me}
        assert len(repl) * etp == len(dpcp_g)
        assert len(expert) == eetp and set(expert) <= set(edp_g)
        assert set(erepl) & set(expert) == {me} and len(erepl) * eetp == len(edp_g)
        assert groups.dense.rank == dense.index(me)
        assert groups.dense.rs_group is not None and groups.dense.rs_group is not groups.dense.ag_group
        # In the same ranks (a spawn of 4 costs ~15 s): an ETP size the data-parallel group
        # cannot hold is refused with a message naming both sizes.
        try:
            build_megatron_etp_groups(ETPConfig(etp_size=2 * len(dp_g), expert_etp_size=eetp))
            too_big = None
        except ValueError as exc:
            too_big = str(exc)
        return {"dense": dense, "replicate": repl, "expert": expert, "expert_replicate": erepl,
                "too_big": too_big, "dp": len(dp_g)}
    finally:
        ps.destroy_model_parallel()


# (TP, CP, EP, ETP, expert ETP) of the default case: it runs in test_megatron_ddp's shared
# 4-rank spawn (one start-up less).
SHARED_LAYOUT = (1, 1, 1, 2, 2)


@pytest.mark.parametrize(
    "tp,cp,ep,etp,eetp,expected",
    [
        # TP = 2: data-parallel groups [0 2], [1 3] are the ETP groups; nothing replicates.
        # (slow: TP 2 layouts also run in test_megatron_linears_tp2_etp2 and the TP2 x ETP2 reshard)
        pytest.param(2, 1, 1, 2, 2, {0: ((0, 2), (0,)), 1: ((1, 3), (1,)), 2: ((0, 2), (2,)), 3: ((1, 3), (3,))},
                     marks=pytest.mark.slow),
        # TP = 1, ETP = 2 of DP = 4: chunks [0 1], [2 3]; replicas [0 2], [1 3].
        (1, 1, 1, 2, 2, {0: ((0, 1), (0, 2)), 1: ((0, 1), (1, 3)), 2: ((2, 3), (0, 2)), 3: ((2, 3), (1, 3))}),
        # CP = 2: DP (without CP) is [0 2] / [1 3]; the replicate group spans the CP peers.
        pytest.param(1, 2, 1, 2, 2, None, marks=pytest.mark.slow),
        # EP = 2: expert-data-parallel groups of 2; experts shard over them, dense over DP = 4.
        pytest.param(1, 1, 2, 4, 2, None, marks=pytest.mark.slow),
    ],
)
def test_layouts(tmp_path_factory, tp, cp, ep, etp, eetp, expected):
    """Also: an ETP size the data-parallel group cannot hold is refused (checked in the same
    ranks, saving a spawn)."""
    if (tp, cp, ep, etp, eetp) == SHARED_LAYOUT:
        from test_megatron_ddp import shared_body

        results = shared_body(tmp_path_factory, "groups_layout")
    else:
        results = run_distributed(_layout, 4, tp, cp, ep, etp, eetp)
    for rank, result in enumerate(results):
        if expected is not None:
            assert (result["dense"], result["replicate"]) == expected[rank], (rank, result)
        message, dp = result["too_big"], result["dp"]
        assert message is not None and f"etp_size={2 * dp}" in message, message
        assert f"data-parallel group size {dp}" in message, message
