#!/usr/bin/env python
"""GPU smoke test: a stock megatron-core GPTModel with MoE (etp grouped experts) trained with
and without ETP, side by side, from the same initial weights and data.

    torchrun --nproc-per-node=2 tools/smoke_megatron_gpt.py [--steps 10] [--etp 2]

Each rank draws its own synthetic tokens (data parallel). The reference model keeps full
weights and all-reduces (averages) every gradient over the world; the ETP model shards all
linears and experts over the ETP group (= the world here) and completes its gradients with
``etp.finalize_grads``. Both step the same torch Adam. Printed per step: both losses and
their relative difference (bf16: expect agreement to ~1e-2, drifting slowly).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import etp  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--etp", type=int, default=0, help="ETP size (default: world size)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "smoke_megatron_gpt.json"))
    args = parser.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())

    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from etp.megatron.groups import build_megatron_etp_groups
    from etp.megatron.model import apply_etp, etp_gpt_layer_spec

    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=2, hidden_size=512, num_attention_heads=8, ffn_hidden_size=1024,
        num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=512,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        moe_token_dispatcher_type="allgather", bf16=True, params_dtype=torch.bfloat16,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
    )
    def build():
        torch.manual_seed(0)
        return GPTModel(config=config, transformer_layer_spec=etp_gpt_layer_spec(num_experts=8),
                        vocab_size=1024, max_sequence_length=256,
                        share_embeddings_and_output_weights=False).cuda()

    base = build()
    ref_base = build()  # megatron modules hold process groups: no deepcopy; copy the weights
    ref_base.load_state_dict(base.state_dict())
    reference = Float16Module(config, ref_base)
    model = Float16Module(config, base)
    etp_size = args.etp or world
    cfg = etp.ETPConfig(etp_size=etp_size, expert_etp_size=etp_size)
    etp_groups = build_megatron_etp_groups(cfg)
    summary = apply_etp(model, cfg, etp_groups)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-3)

    def loss_of(m, tokens):
        labels = torch.roll(tokens, -1, dims=1)
        position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        per_token = m(tokens, position_ids, None, labels=labels)  # [b, s]
        return per_token.float().mean()

    rows = []
    for step in range(args.steps):
        gen = torch.Generator(device="cuda").manual_seed(100 * step + rank)
        tokens = torch.randint(0, 1024, (2, 256), device="cuda", generator=gen)
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        loss = loss_of(model, tokens)
        loss.backward()
        etp.finalize_grads(model, cfg, etp_groups)
        opt.step()
        ref_loss = loss_of(reference, tokens)
        ref_loss.backward()
        for p in reference.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        ref_opt.step()
        pair = torch.stack([loss.detach(), ref_loss.detach()])
        dist.all_reduce(pair)
        pair /= world
        rows.append({"step": step, "etp_loss": pair[0].item(), "ref_loss": pair[1].item(),
                     "rel_diff": abs(pair[0].item() - pair[1].item()) / pair[1].item()})
        if rank == 0:
            print(f"step {step:3d}  etp {rows[-1]['etp_loss']:.5f}  ref {rows[-1]['ref_loss']:.5f}  "
                  f"rel {rows[-1]['rel_diff']:.2e}", flush=True)
    if rank == 0:
        report = {"command": " ".join(["torchrun", f"--nproc-per-node={world}"] + sys.argv),
                  "wrapped": summary.params_wrapped, "bytes_before": summary.bytes_before,
                  "bytes_after": summary.bytes_after, "steps": rows,
                  "runtime_stats": etp.runtime_of(model).stats.__dict__}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(summary)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
