"""The steps of ``tools/reproduce.py``: one per table of BENCHMARKS.md (and the GPU test
suites), each a few commands with an estimate and a timeout, built for the GPUs at hand.

A step named ``..._{k}gpu`` runs on the first k GPUs (``CUDA_VISIBLE_DEVICES``), so one
machine of N GPUs produces the 2-GPU rows and the N-GPU rows. Commands are written as
BENCHMARKS.md prints them (``torchrun ...``, ``python3 ...``); the runner starts them with
this interpreter.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from . import headlines

__all__ = ["Run", "Step", "build_steps"]

TRAIN = "torchrun --standalone --nproc-per-node {k} -m etp.train"
FLAGSHIP = "--recipe recipes/moe_flagship.yaml"
WIDE = "--recipe recipes/moe_wide.yaml"
# The peer at megatron-core's recommended MoE settings: ETP off, the distributed optimizer with
# overlapped parameter all-gather and gradient reduction (which cannot be captured).
DISTOPT = ("--set etp.etp_size=1 --set etp.expert_etp_size=1 --set use_distributed_optimizer=true "
           "--set overlap_grad_reduce=true --set overlap_param_gather=true --set cuda_graph=none")
# The hand-written best of the wide recipe before auto settings: FP8 gathers kept for the step, eager.
FP8_STEP_EAGER = ("--set etp.gather_dtype=fp8_tensorwise --set etp.gather_reuse=step --set cuda_graph=none "
                  "--set micro_batch_size=16")
CAPTURED = "--set cuda_graph=step"


@dataclass(frozen=True)
class Run:
    """One command of a step: its output files are named after it in the step's folder."""

    name: str
    command: str          # as BENCHMARKS.md prints it; {json} / {log} / {dir} filled in by the runner
    gpus: int             # visible GPUs (CUDA_VISIBLE_DEVICES=0..gpus-1)
    est_s: int            # what it took on 4xH100, start-up included
    timeout_s: int
    env: tuple[str, ...] = ()  # extra KEY=VALUE
    figures: str | None = None  # its JSON's reader in check.FIGURES ([Note: the regression check])
    reported: dict = field(default_factory=dict)  # GPU kind -> the benchmarks/ file BENCHMARKS.md reports


@dataclass(frozen=True)
class Step:
    """A table of BENCHMARKS.md (or a GPU test suite): its runs, and the figure it reports."""

    name: str
    section: str
    runs: tuple[Run, ...]
    headline: object = field(default=headlines.none, repr=False)  # (step, folder) -> str
    stop_on_failure: bool = False  # later runs need the earlier ones (a resume needs its save)

    @property
    def est_s(self) -> int:
        return sum(r.est_s for r in self.runs)


def _train(k: int, recipe: str, extra: str = "", iters: int = 20) -> str:
    """etp-train on k GPUs: the recipe's own settings (auto) plus ``extra``."""
    return (f"{TRAIN.format(k=k)} {recipe} {extra} --train-iters {iters} --log-interval 1 "
            "--json {json}").replace("  ", " ")


def expert_stack(k: int) -> Step:
    cmd = f"torchrun --standalone --nproc-per-node {k} tools/bench_expert_stack.py --rounds 2 --out {{json}}"
    return Step(f"expert_stack_{k}gpu", "Expert stack against its peers",
                (Run("expert_stack", cmd, k, 200, 420),), headlines.expert_stack)


def recipes_wide(k: int) -> Step:
    """The defaults, the best hand-written command before auto, and the peer at half and a quarter of
    a rank's share of the batch (its largest that fit: 32 of 64 on 2×H200, 16 of 32 on 4×H100)."""
    share = 128 // k
    runs = (Run("etp_defaults", _train(k, WIDE), k, 50, 180, figures="recipe",
                reported={"2xh200": "recipe_wide_defaults_2xh200_21f815f.json",
                          "4xh100": "recipe_wide_defaults_4xh100_3e009d7.json"}),
            Run("etp_fp8_step_eager", _train(k, WIDE, FP8_STEP_EAGER), k, 45, 180),
            *(Run(f"distopt_mb{mb}", _train(k, WIDE, f"{DISTOPT} --set micro_batch_size={mb}"), k, 50, 180)
              for mb in (share // 2, share // 4)))
    return Step(f"recipes_wide_{k}gpu", "The recipes against their peers", runs, headlines.recipes)


def recipes_flagship(k: int) -> Step:
    """The defaults (micro_batch_size auto), micro-batch 2, and the peer at a rank's whole share of
    the batch and at half of it."""
    share = 32 // k
    runs = (Run("etp_defaults", _train(k, FLAGSHIP), k, 50, 180, figures="recipe",
                reported={"2xh200": "recipe_flagship_defaults_2xh200_21f815f.json",
                          "4xh100": "recipe_flagship_defaults_4xh100_4099d62.json",
                          "4xh200": "recipe_flagship_defaults_4xh200_2f53541.json"}),
            Run("etp_mb2", _train(k, FLAGSHIP, "--set micro_batch_size=2"), k, 50, 180),
            *(Run(f"distopt_mb{mb}", _train(k, FLAGSHIP, f"{DISTOPT} --set micro_batch_size={mb}"), k, 50, 180)
              for mb in (share, share // 2)))
    return Step(f"recipes_flagship_{k}gpu", "The recipes against their peers", runs, headlines.recipes)


def recipes_deepseek_v3_features() -> Step:
    """DeepSeek-V3's features (64 experts, sequences of 4096) on 2 GPUs of 140 GiB (H200): etp at its
    defaults beside the distributed optimizer, Megatron-FSDP and torch FSDP2 at micro-batch 4."""
    features = ("--recipe recipes/deepseek_v3_shaped.yaml --set num_experts=64 --set expert_model_parallel_size=1 "
                "--set moe_token_dispatcher_type=local --set seq_length=4096")
    runs = (Run("etp_defaults", _train(2, features, "--audit {dir}/etp_defaults_audit.json", 12), 2, 60, 180),
            Run("distopt_mb4", _train(2, features, f"{DISTOPT} --set micro_batch_size=4", 12), 2, 45, 180),
            Run("megatron_fsdp_mb4", _train(2, features, "--set use_megatron_fsdp=true --set micro_batch_size=4", 12),
                2, 50, 180),
            Run("fsdp2_mb4", _train(2, features, "--set use_torch_fsdp2=true --set micro_batch_size=4", 12), 2, 45, 180))
    return Step("recipes_deepseek_v3_features_2gpu", "The recipes against their peers", runs, headlines.recipes)


def tune(k: int, label: str, names: tuple[str, ...]) -> Step:
    """``etp-train --tune`` on each recipe, capture and FP8 gathers pinned (what auto picks on sm90):
    the candidates are ``gather_reuse`` x the three largest micro-batches that fit."""
    pinned = "--set cuda_graph=step --set etp.gather_dtype=fp8_tensorwise"
    runs = tuple(Run(f"tune_{name}", f"python3 -m etp.train --recipe recipes/{name}.yaml {pinned} "
                                     f"--tune {{dir}}/{name}_best.yaml --json {{json}}", k, 240, 480) for name in names)
    return Step(f"tune_{label}_{k}gpu", "The recipes against their peers", runs, headlines.none)


def recipes_architectures(k: int) -> Step:
    """The published architectures' recipes at their defaults against every peer that fits 80 GiB,
    each at its largest micro-batch that fits (the distributed optimizer fits OLMoE only, at 2), and
    DeepSeek-V3's features on 64 experts."""
    def arch(name: str, extra: str = "", iters: int = 14) -> str:
        return _train(k, f"--recipe recipes/{name}.yaml", extra, iters)

    fsdp2, mfsdp = "--set use_torch_fsdp2=true --set micro_batch_size={}", "--set use_megatron_fsdp=true --set micro_batch_size={}"
    runs = (Run("olmoe_defaults", arch("olmoe_1b_7b", "--audit {dir}/olmoe_audit.json"), k, 45, 180),
            Run("olmoe_distopt_mb2", arch("olmoe_1b_7b", f"{DISTOPT} --set micro_batch_size=2"), k, 40, 180),
            Run("olmoe_fsdp2_mb4", arch("olmoe_1b_7b", fsdp2.format(4)), k, 35, 180),
            Run("olmoe_mfsdp_mb4", arch("olmoe_1b_7b", mfsdp.format(4)), k, 35, 180),
            Run("qwen3_defaults", arch("qwen3_30b_a3b", "--audit {dir}/qwen3_audit.json"), k, 55, 180),
            Run("qwen3_fsdp2_mb4", arch("qwen3_30b_a3b", fsdp2.format(4)), k, 40, 180),
            Run("qwen3_mfsdp_mb4", arch("qwen3_30b_a3b", mfsdp.format(4)), k, 40, 180),
            Run("mixtral_defaults", arch("mixtral_8x7b", "--audit {dir}/mixtral_audit.json", 12), k, 40, 180),
            Run("mixtral_fsdp2_mb4", arch("mixtral_8x7b", fsdp2.format(4), 12), k, 40, 180),
            Run("mixtral_mfsdp_mb2", arch("mixtral_8x7b", mfsdp.format(2), 12), k, 40, 180),  # 4: out of memory
            # DeepSeek-V3's features where its widths cannot fit: 64 experts over expert ETP, eager
            Run("deepseek_v3_64_experts", arch("deepseek_v3_shaped", "--set num_experts=64 --set expert_model_parallel_size=1 "
                                               "--set moe_token_dispatcher_type=local --set cuda_graph=none --set seq_length=4096 "
                                               "--audit {dir}/deepseek_v3_audit.json", 20), k, 60, 180))
    return Step(f"recipes_architectures_{k}gpu", "The recipes against their peers", runs, headlines.recipes)


def precision_olmoe(k: int) -> Step:
    """OLMoE with FP8 gathers against bf16 over 300 iterations, on a grammar corpus too large to
    memorize (tools/make_tiny_corpus.py); then the verdict on the last 20 losses and the plot."""
    data = "--recipe recipes/olmoe_1b_7b.yaml --set data={dir}/grammar.txt --set micro_batch_size=1"
    train = f"{TRAIN.format(k=k)} {data} --train-iters 300 --log-interval 10 --json {{json}}"
    compare = ("python3 tools/compare_recipe_runs.py --etp {dir}/fp8.json --baseline {dir}/bf16.json "
               "--labels FP8,bf16 --window 20 --tolerance 0.01 --plot {dir}/losses.png --floor 0.1787")
    runs = (Run("corpus", "python3 tools/make_tiny_corpus.py --lines 4000000 --out {dir}/grammar.txt", 0, 15, 120),
            Run("fp8", train, k, 215, 420),
            Run("bf16", f"{train} --set etp.gather_dtype=param", k, 210, 420),
            Run("compare", compare, 0, 5, 60))
    return Step(f"precision_olmoe_{k}gpu", "The recipes against their peers", runs, headlines.none,
                stop_on_failure=True)


def graphs_flagship(k: int) -> Step:
    """The flagship eager and captured, bf16 gathers (the defaults would pick FP8 when captured)."""
    bf16 = "--set etp.gather_dtype=param --set etp.gather_reuse=chain --set micro_batch_size=2"
    runs = (Run("eager_bf16", _train(k, FLAGSHIP, f"{bf16} --set cuda_graph=none"), k, 45, 180),
            Run("captured_bf16", _train(k, FLAGSHIP, f"{bf16} {CAPTURED}"), k, 45, 180))
    return Step(f"graphs_flagship_{k}gpu", "CUDA graphs", runs, headlines.recipes)


def memory_audit(k: int) -> Step:
    audit = "--audit {dir}/{name}_audit.json --set lr_warmup_iters=2"
    runs = (Run("flagship", _train(k, FLAGSHIP, f"{audit} --set micro_batch_size=2", iters=10), k, 35, 150),
            Run("wide", _train(k, WIDE, f"{audit} --set micro_batch_size=16", iters=10), k, 35, 150),
            Run("flagship_distopt", _train(k, FLAGSHIP, f"{audit} {DISTOPT} --set micro_batch_size=2", iters=10),
                k, 40, 150),
            )
    return Step(f"memory_audit_{k}gpu", "The memory audit against measured peaks", runs, headlines.memory_audit)


def cross_entropy() -> Step:
    """The language-model loss's time and memory beside megatron-core's (one GPU)."""
    return Step("cross_entropy_1gpu", "The memory audit against measured peaks",
                (Run("cross_entropy", "python3 tools/bench_cross_entropy.py --out {json}", 1, 35, 120,
                     figures="cross_entropy", reported={"1xh100": "cross_entropy_1xh100_a3140a5.json",
                                                        "1xh200": "cross_entropy_1xh200_b6ec2b3.json"}),),
                headlines.none)


def recipes_1gpu() -> Step:
    """The recipes that fit one GPU at their defaults (world 1: nothing to shard, etp's kernels,
    losses and captured step alone)."""
    runs = (Run("flagship_defaults", _train(1, FLAGSHIP), 1, 60, 240, figures="recipe",
                reported={"1xh200": "recipe_flagship_defaults_1xh200_6709d0d.json"}),
            Run("olmoe_defaults", _train(1, "--recipe recipes/olmoe_1b_7b.yaml", iters=14), 1, 60, 240, figures="recipe",
                reported={"1xh200": "recipe_olmoe_defaults_1xh200_6709d0d.json"}))
    return Step("recipes_1gpu", "The recipes against their peers", runs, headlines.recipes)


def around_the_step() -> list[Step]:
    """One GPU: what data, per-document masks, metrics and saves cost the flagship's step; a
    full-width Qwen3-MoE through import, fine-tuning and export against transformers."""
    costs = "python3 tools/bench_run_costs.py --iters 12 --out {json}"
    hf = "python3 tools/hf_round_trip.py --layers 4 --iters 4 --timeout 240 --out {json}"
    return [Step("run_costs_1gpu", "Around the step: data, per-document masks, metrics",
                 (Run("run_costs", costs, 1, 420, 570),), headlines.none),
            Step("hf_round_trip_1gpu", "Around the step: data, per-document masks, metrics",
                 (Run("hf_round_trip", hf, 1, 420, 600),), headlines.none)]


def torchtitan() -> Step:
    """One GPU: etp-train against torchtitan's trainer (and megatron-core's own paths) on a
    Qwen3-30B-A3B-shaped model at 4 layers (torchtitan 0.2.2 must be importable)."""
    cmd = "python3 tools/bench_torchtitan.py --layers 4 --steps 20 --out {json}"
    run = Run("torchtitan", cmd, 1, 345, 420, figures="torchtitan", reported={"1xh200": "torchtitan_1xh200_b6ec2b3.json"})
    return Step("torchtitan_1gpu", "The recipes against their peers", (run,),
                headlines.none)


def checkpoint(k: int) -> Step:
    """Saved at ETP k, resumed from iteration 10 at three other layouts (2 layers, 16 experts)."""
    small = ("--set num_layers=2 --set num_experts=16 --set global_batch_size=16 --set micro_batch_size=2 "
             "--set save_interval=10")
    resume = "--set load={scratch}/saved --set save={scratch}/{name} --resume 10"
    half = max(1, k // 2)
    at = "--set etp.etp_size={e} --set etp.expert_etp_size={e}"
    distopt = "--set use_distributed_optimizer=true"
    runs = (Run("saved", _train(k, FLAGSHIP, f"{small} --set save={{scratch}}/saved"), k, 45, 180),
            Run(f"etp{half}_{half}gpu", _train(half, FLAGSHIP, f"{small} {resume}"), half, 45, 180),
            Run(f"etp{half}_distopt_{k}gpu", _train(k, FLAGSHIP, f"{small} {distopt} {at.format(e=half)} {resume}"),
                k, 45, 180),
            Run(f"etp1_{k}gpu", _train(k, FLAGSHIP, f"{small} {at.format(e=1)} {resume}"), k, 45, 180))
    return Step(f"checkpoint_{k}gpu", "Checkpoint resharding", runs, headlines.checkpoint, stop_on_failure=True)


def kernels() -> Step:
    adam = "python3 tools/bench_adam.py --recipe recipes/qwen3_30b_a3b.yaml --etp 4 --out {json}"
    return Step("kernels_1gpu", "FP8 kernels against copy bandwidth",
                (Run("kernels", "python3 tools/bench_kernels.py --out {json}", 1, 60, 240, figures="kernels",
                     reported={"1xh200": "kernels_1xh200_b6ec2b3.json"}),
                 Run("adam", adam, 1, 40, 180, figures="adam",
                     reported={"1xh100": "adam_qwen3_etp4_1xh100_3e009d7.json",
                               "1xh200": "adam_qwen3_etp4_1xh200_b6ec2b3.json"})), headlines.kernels)


def expert_parallel(k: int) -> list[Step]:
    moves = f"torchrun --standalone --nproc-per-node {k} tools/bench_ep.py --workloads sonicmoe,deepseek_v3 --out {{json}}"
    dispatcher = (f"torchrun --standalone --nproc-per-node {k} tools/bench_ep_megatron.py "
                  "--workloads sonicmoe,deepseek_v3 --etp-backends symm_dedup --out {json}")
    return [Step(f"ep_moves_{k}gpu", "Expert parallelism", (Run("ep_moves", moves, k, 150, 300),), headlines.ep_moves),
            Step(f"ep_dispatcher_{k}gpu", "Expert parallelism", (Run("ep_dispatcher", dispatcher, k, 90, 240),),
                 headlines.ep_dispatcher)]


def gpu_tests(n: int) -> list[Step]:
    """The test files that need a GPU (``needs CUDA`` skips, ``ETP_TEST_BACKEND=nccl``)."""
    nccl = ("ETP_TEST_BACKEND=nccl", "ETP_TEST_TIMEOUT=240")
    suites = (
        ("tests_kernels", 1, (), "tests/kernels tests/test_fp8.py tests/test_gemm.py", 360),
        ("tests_transport", n, nccl, "tests/transport/test_transport_gpu.py tests/transport/test_stream_ops_gpu.py "
                                     "tests/test_graphs_gpu.py", 300),
        ("tests_megatron", n, nccl, "tests/train/test_fp8_recipe_gpu.py tests/train/test_megatron_train_gpu.py "
                                    "tests/megatron/test_attention_gpu.py tests/megatron/test_local_dispatcher.py "
                                    "tests/megatron/test_megatron_fallbacks.py tests/megatron/test_rope_install.py "
                                    "tests/megatron/test_fused_adamw.py tests/megatron/test_document_attention.py "
                                    "tests/train/test_megatron_step_gpu.py tests/train/test_moe_metrics.py "
                                    "tests/audit/test_memory_audit.py", 300),
        ("tests_ep", n, nccl, "tests/ep/test_ep_gpu.py tests/megatron/test_ep_megatron.py", 180),
        (f"tests_parity_{n}gpu", n, (*nccl, f"ETP_TEST_SIZES=2,{n}"),
         "tests/test_parity.py tests/megatron/test_megatron_linears.py", 300),
        ("tests_graph_step", n, nccl, "tests/train/test_captured_step.py", 420),
        ("tests_fsdp_peers", n, nccl, "tests/train/test_megatron_fsdp_gpu.py", 150),
    )
    return [Step(name, "GPU test suites", (Run(name, f"python3 -m pytest -q -p no:cacheprovider {files}", gpus,
                                               est, 2 * est, env),), headlines.pytest)
            for name, gpus, env, files, est in suites]


def build_steps(n: int) -> list[Step]:
    """Every step for a machine of ``n`` GPUs, in the report's order: the 2-GPU and the n-GPU
    rows of each table (one set when n is 2); on one GPU, the steps that fit it.

    Example::

        [s.name for s in build_steps(4)][:3]   # ['expert_stack_2gpu', 'expert_stack_4gpu', 'recipes_wide_2gpu']
        [s.name for s in build_steps(1)][:5]   # [..., 'recipes_1gpu', 'tests_kernels', 'tests_megatron']
    """
    if n == 1:  # the regression check's steps first: a --budget of 540 s holds those
        # tests_megatron at one rank: its one-GPU files run (megatron-core's internals, FlexAttention,
        # the world-1 AdamW step); the 2-GPU ones skip themselves.
        one_gpu_suites = [s for s in gpu_tests(1) if s.name in ("tests_kernels", "tests_megatron")]
        return [kernels(), cross_entropy(), recipes_1gpu(), *one_gpu_suites, torchtitan(), *around_the_step()]
    sizes = sorted({2, n})
    steps = [expert_stack(k) for k in sizes]
    steps += [make(k) for make in (recipes_wide, recipes_flagship) for k in sizes]
    steps.append(recipes_deepseek_v3_features())
    steps += [tune(k, "recipes", ("moe_flagship", "moe_wide")) for k in sizes]
    if n >= 4:  # the architectures' recipes are sized for 4 GPUs of 80 GiB
        steps += [recipes_architectures(n), precision_olmoe(n),
                  tune(n, "architectures", ("olmoe_1b_7b", "qwen3_30b_a3b", "mixtral_8x7b"))]
    steps.append(kernels())
    steps += [s for k in sizes for s in expert_parallel(k)]
    steps += [memory_audit(k) for k in sizes]
    steps.append(cross_entropy())
    steps.append(checkpoint(n))
    steps += [graphs_flagship(k) for k in sizes]
    steps += gpu_tests(n)
    return steps


def fill(command: str, folder: Path, run: Run, scratch: Path) -> str:
    """The command with its output paths: ``{json}`` and ``{dir}`` in the step's folder."""
    return (command.replace("{json}", str(folder / f"{run.name}.json")).replace("{dir}", str(folder))
            .replace("{scratch}", str(scratch)).replace("{name}", run.name))
