"""``auto`` recipe settings, chosen at start-up for the machine and the launcher.

[Note: auto settings]
A recipe that says ``auto`` gets the setting etp's benchmarks found fastest where the recipe
and the machine allow it; each choice is printed once with its reason, and an explicit value
always wins. In the order they are decided:

* ``world_size`` unset: the launcher's (torchrun's ``WORLD_SIZE``).
* ``etp.etp_size`` / ``etp.expert_etp_size: auto``: the data-parallel ranks of one host (the
  copy-engine transports move bytes over NVLink inside a host), the largest divisor of the
  data-parallel size that fits there.
  With ``use_torch_fsdp2`` or ``use_megatron_fsdp`` both are 1: the FSDP shards every weight itself.
* ``micro_batch_size: auto``: the largest micro-batch that divides each rank's share of
  ``global_batch_size`` and that the memory audit predicts to fit the GPU once the settings
  below are chosen for it (the rank's whole share on CPU, with no GPU to size against). Each
  micro-batch pays the step's fixed costs again (every weight's gather, every launch or graph
  replay, the expert GEMMs' ragged tails), so fewer, larger ones are faster while they fit
  (BENCHMARKS.md, "Recipes": micro-batch 4 against 2 on the flagship, 2 against 1 on OLMoE,
  etp and its peers alike).
* ``cuda_graph: auto``: ``step`` wherever the recipe can be captured (CUDA; megatron's
  dispatchers, activation recompute, tensor parallelism and both FSDPs cannot; etp's dispatcher
  can, handing the experts its padded receive buffer, so only where the memory audit says those
  rows fit), ``none`` otherwise. A
  captured step issues no host launches: small micro-batches stop being bound by the host.
  Capture turns ``overlap_grad_reduce`` off itself (DDP's reductions start after the
  replayed backward).
* ``etp.gather_dtype: auto``: ``fp8_tensorwise`` on sm90+ with bf16 training when the step is
  not bound by its host: captured, or eager with at least ``FP8_EAGER_TOKENS`` tokens per
  micro-batch; bf16 (the parameters' own) otherwise. An eager FP8 GEMM issues more launches
  than a bf16 one, so on a host-bound eager step FP8 is slower although it moves half the bytes
  (BENCHMARKS.md, "Recipes"), unless only FP8's halved gathers fit the GPU (memory audit).
* ``etp.gather_reuse: auto``: the most reuse the memory audit predicts to fit the GPU ("step"
  with several micro-batches, "pass" with one, else "chain"); "chain" without a GPU to size
  against.

Both gather keys govern ETP-sharded weights only. Where the ETP sizes (the recipe's or auto's)
are both 1 no weight is sharded (``wrap_module_params_etp`` leaves the model untouched), so
they cannot change the run: auto says so ("inert: nothing is sharded") and takes the values
that hold nothing ("param", "chain"), and ``--tune`` does not time them (``inert_auto_keys``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from etp.recipe.validation import RecipeError

__all__ = ["FP8_EAGER_TOKENS", "GATHER_KEYS", "QUANTIZED_GATHERS", "Machine", "inert_auto_keys", "kept_reuse",
           "nothing_sharded", "quantized_gathers_refusal", "resolve_auto"]

#: Tokens per micro-batch from which an eager step's GEMMs are long enough for FP8 to pay.
FP8_EAGER_TOKENS = 16384

#: The quantized gather format ``auto`` and ``--tune`` weigh against the parameters' own: the
#: measured best (BENCHMARKS.md, "Recipes"). Whether it applies, its format object says.
QUANTIZED_GATHERS = "fp8_tensorwise"

#: The auto keys that set how ETP-sharded weights travel and stay gathered: with no weight
#: sharded they change nothing.
GATHER_KEYS = ("etp.gather_dtype", "etp.gather_reuse")


@dataclass(frozen=True)
class Machine:
    """What ``auto`` decides against: the ranks launched, how many share a host, the GPU.

    Example::

        Machine.detect()                           # from torchrun's environment and torch.cuda
        Machine(world_size=4, ranks_per_host=4)    # a CPU run of 4 ranks
    """

    world_size: int
    ranks_per_host: int
    cuda: bool = False
    gpu_name: str | None = None
    gpu_memory: int | None = None  # bytes of one GPU
    sm90: bool = False  # FP8 GEMMs (torch._scaled_mm) run

    @classmethod
    def detect(cls, world_size: int | None = None) -> "Machine":
        """This process's launcher (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``) and its GPU, if any."""
        import torch

        world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
        per_host = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        if not torch.cuda.is_available():
            return cls(world, per_host)
        props = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        return cls(world, per_host, True, props.name, props.total_memory, props.major >= 9)


def _largest_divisor_up_to(n: int, limit: int) -> int:
    return max(d for d in range(1, max(1, min(n, limit)) + 1) if n % d == 0)


def _etp_sizes(recipe, machine: Machine, notes: list[str]) -> dict:
    p = recipe.parallel
    chosen = {}
    if p.fsdp_peer:
        for key in ("etp.etp_size", "etp.expert_etp_size"):
            if key in recipe.auto:
                chosen[key[4:]] = 1
                notes.append(f"{key} auto -> 1: {p.fsdp_peer} shards every weight over the data-parallel "
                             "ranks itself (ETP off)")
        return chosen
    if "etp.etp_size" in recipe.auto:
        dp = recipe.data_parallel_size(machine.world_size)
        per_host = max(1, machine.ranks_per_host // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size
                                                      * p.context_parallel_size))
        chosen["etp_size"] = _largest_divisor_up_to(dp, per_host)
        notes.append(f"etp.etp_size auto -> {chosen['etp_size']}: the data-parallel ranks of one host "
                     f"(data-parallel size {dp})")
    if "etp.expert_etp_size" in recipe.auto and recipe.model.is_moe:
        edp = recipe.expert_data_parallel_size(machine.world_size)
        per_host = max(1, machine.ranks_per_host // (p.expert_model_parallel_size * p.expert_tensor_parallel_size
                                                      * p.pipeline_model_parallel_size))
        chosen["expert_etp_size"] = _largest_divisor_up_to(edp, per_host)
        notes.append(f"etp.expert_etp_size auto -> {chosen['expert_etp_size']}: the expert-data-parallel ranks "
                     f"of one host (expert-data-parallel size {edp})")
    return chosen


def nothing_sharded(recipe, machine: Machine) -> str | None:
    """Why no weight of ``recipe`` is ETP-sharded on ``machine`` (``"inert: ..."``, the reason
    ``auto`` and ``--tune`` give for the ``GATHER_KEYS``), or None where some weight is.

    Decided from the ETP sizes the recipe sets, or auto picks where it says auto, before any
    model is built: ``wrap_module_params_etp`` shards nothing exactly when both are 1 (dense
    weights shard over ``etp_size``, routed experts over ``expert_etp_size``; every model has
    dense attention weights, so ``etp_size`` above 1 alone shards some).

    Example::

        nothing_sharded(Recipe.from_yaml("recipes/moe_flagship.yaml"), Machine(1, 1))
        # 'inert: nothing is sharded (ETP size 1: etp.etp_size and etp.expert_etp_size are 1)'
    """
    chosen = _etp_sizes(recipe, machine, [])
    sizes = (chosen.get("etp_size", recipe.etp.etp_size), chosen.get("expert_etp_size", recipe.etp.expert_etp_size))
    if sizes != (1, 1):
        return None
    if recipe.parallel.fsdp_peer:
        return f"inert: nothing is sharded by ETP ({recipe.parallel.fsdp_peer} shards every weight itself, ETP size 1)"
    return "inert: nothing is sharded (ETP size 1: etp.etp_size and etp.expert_etp_size are 1)"


def inert_auto_keys(recipe, machine: Machine) -> dict[str, str]:
    """The ``auto`` keys of ``recipe`` that cannot change its run on ``machine``, each with why:
    what ``--tune`` does not time.

    Example::

        inert_auto_keys(Recipe.from_yaml("recipes/moe_flagship.yaml"), Machine(1, 1))
        # {'etp.gather_dtype': 'inert: nothing is sharded ...', 'etp.gather_reuse': 'inert: ...'}
    """
    why = nothing_sharded(recipe, machine)
    return {key: why for key in GATHER_KEYS if key in recipe.auto} if why else {}


def _micro_batch(recipe, machine: Machine, notes: list[str]) -> int | None:
    if "micro_batch_size" not in recipe.auto:
        return None
    per_rank = recipe.samples_per_rank(machine.world_size)
    if machine.gpu_memory is None:
        notes.append(f"micro_batch_size auto -> {per_rank}: each rank's share of the global batch in one "
                     "micro-batch (no GPU memory to size it against)")
        return per_rank
    from etp.audit import fits, predict_peak

    for size in (m for m in range(per_rank, 0, -1) if per_rank % m == 0):
        candidate, _ = resolve_auto(recipe.replace(micro_batch_size=size), machine)
        peak = predict_peak(candidate, machine.world_size)
        if fits(peak, machine.gpu_memory):
            notes.append(f"micro_batch_size auto -> {size}: the largest that divides each rank's {per_rank} "
                         f"samples and fits (memory audit: {peak['device_peak'] / 2**30:.1f} GiB of "
                         f"{machine.gpu_memory / 2**30:.0f}); fewer micro-batches pay the step's fixed costs "
                         "fewer times")
            return size
    notes.append("micro_batch_size auto -> 1: the memory audit predicts that no micro-batch fits this GPU "
                 "(etp-audit --recipe ... says where the memory goes)")
    return 1


def _cuda_graph(recipe, machine: Machine, notes: list[str]) -> str | None:
    if "cuda_graph" not in recipe.auto:
        return None
    if not machine.cuda:
        notes.append("cuda_graph auto -> none: no CUDA here")
        return "none"
    if recipe.model.is_moe and not machine.sm90:
        notes.append("cuda_graph auto -> none: grouped expert GEMMs need sm90+ to be captured (older GPUs run "
                     "one GEMM per expert, sized on the host)")
        return "none"
    try:
        recipe.replace(cuda_graph="step")
    except RecipeError as error:
        notes.append(f"cuda_graph auto -> none: this recipe cannot be captured ({error})")
        return "none"
    if recipe.model.is_moe and recipe.model.moe_token_dispatcher_type == "etp":
        return _capture_etp_dispatcher(recipe, machine, notes)
    notes.append("cuda_graph auto -> step: every micro-batch replays one captured forward + backward "
                 "(no host launches)")
    return "step"


def _capture_etp_dispatcher(recipe, machine: Machine, notes: list[str]) -> str:
    """Captured, etp's dispatcher hands the experts its padded receive buffer, EP x min(topk,
    local experts) rows per token where eager hands them topk (``padded_expert_rows``): the
    step is captured where the memory audit says those rows fit, with the gathers auto would
    then take (FP8 where it can, the least reuse), and stays eager otherwise."""
    from etp.audit import fit_bytes, padded_expert_rows, predict_peak

    captured = recipe.replace(cuda_graph="step")
    etp = {"gather_dtype": _gather_dtype(captured, machine, True, []),  # auto's own choice for a captured step
           "gather_reuse": "chain" if "etp.gather_reuse" in recipe.auto else None}
    if any(value is not None for value in etp.values()):
        captured = captured.replace(etp={key: value for key, value in etp.items() if value is not None})
    rows = padded_expert_rows(captured)
    if machine.gpu_memory is not None:
        need = fit_bytes(predict_peak(captured, machine.world_size))
        if need > machine.gpu_memory:
            notes.append(f"cuda_graph auto -> none: captured, etp's dispatcher hands the experts {rows} rows per "
                         f"token (its padded receive buffer), which do not fit (memory audit: "
                         f"{need / 2**30:.1f} GiB of {machine.gpu_memory / 2**30:.0f})")
            return "none"
    notes.append(f"cuda_graph auto -> step: every micro-batch replays one captured forward + backward, etp's "
                 f"dispatcher with its padded receive buffer ({rows} expert rows per token, counted by the memory "
                 "audit)")
    return "step"


def quantized_gathers_refusal(recipe, machine: Machine) -> str | None:
    """Why ``QUANTIZED_GATHERS`` does not apply to ``recipe`` on ``machine`` (its GEMMs would not
    pay there, or it cannot take the recipe's dtype), as its format object says; None: it applies.

    Example::

        quantized_gathers_refusal(Recipe.from_yaml("recipes/tiny_moe_cpu.yaml"), Machine(2, 2))
        # 'FP8 GEMMs need an sm90+ GPU'
    """
    from etp.formats import gather_format

    fmt = gather_format(QUANTIZED_GATHERS)
    return fmt.not_fast_on(machine.sm90) or fmt.unsupported(recipe.train.params_dtype)


def _gather_dtype(recipe, machine: Machine, captured: bool, notes: list[str]) -> str | None:
    if "etp.gather_dtype" not in recipe.auto:
        return None
    inert = nothing_sharded(recipe, machine)
    if inert:  # the parameters' own dtype: no quantization step for weights that never travel
        notes.append(f"etp.gather_dtype auto -> param: {inert}")
        return "param"
    tokens = recipe.train.micro_batch_size * recipe.model.seq_length
    quantized = QUANTIZED_GATHERS
    why = quantized_gathers_refusal(recipe, machine)
    if why:
        notes.append(f"etp.gather_dtype auto -> param: {why}")
        return "param"
    if captured or tokens >= FP8_EAGER_TOKENS:
        why = "a captured step" if captured else f"{tokens} tokens per micro-batch (>= {FP8_EAGER_TOKENS})"
        notes.append(f"etp.gather_dtype auto -> {quantized}: half the gathered bytes and FP8 GEMMs pay on {why}")
        return quantized
    if machine.gpu_memory is not None:
        from etp.audit import fit_bytes, predict_peak

        # Fitting comes before speed: FP8 gathers hold half the gathered bytes.
        need = {dtype: fit_bytes(predict_peak(recipe.replace(etp={"gather_dtype": dtype, "gather_reuse": "chain"}),
                                              machine.world_size)) for dtype in ("param", quantized)}
        if need["param"] > machine.gpu_memory >= need[quantized]:
            notes.append(f"etp.gather_dtype auto -> {quantized}: only FP8 gathers fit this GPU (the memory audit "
                         f"with its margins: bf16 {need['param'] / 2**30:.1f} GiB, FP8 "
                         f"{need[quantized] / 2**30:.1f} GiB of {machine.gpu_memory / 2**30:.0f})")
            return quantized
    notes.append(f"etp.gather_dtype auto -> param: an eager step of {tokens} tokens per micro-batch is bound by "
                 "its host, where FP8's extra launches cost more than its bytes save")
    return "param"


def kept_reuse(recipe, world_size: int) -> str:
    """The ``gather_reuse`` that keeps every weight gathered as long as its micro-batches allow:
    ``step`` across several micro-batches, ``pass`` (forward to backward) for one. What ``auto``
    takes when it fits, and ``--tune``'s candidate beside ``chain``."""
    return "step" if recipe.num_microbatches(world_size) > 1 else "pass"


def _gather_reuse(recipe, machine: Machine, notes: list[str]) -> str | None:
    if "etp.gather_reuse" not in recipe.auto:
        return None
    inert = nothing_sharded(recipe, machine)
    if inert:  # "chain": no resident buffers for weights that are never gathered
        notes.append(f"etp.gather_reuse auto -> chain: {inert}")
        return "chain"
    if machine.gpu_memory is None:
        notes.append("etp.gather_reuse auto -> chain: no GPU memory to size the resident weights against")
        return "chain"
    from etp.audit import fits, predict_peak

    for reuse in (kept_reuse(recipe, machine.world_size), "chain"):
        candidate = recipe.replace(etp={"gather_reuse": reuse})
        peak = predict_peak(candidate, machine.world_size)
        if reuse == "chain" or fits(peak, machine.gpu_memory):
            span = "for the whole step" if reuse == "step" else "from its forward to its backward"
            why = (f"every weight stays gathered {span}: the memory audit predicts "
                   f"{peak['device_peak'] / 2**30:.1f} GiB of {machine.gpu_memory / 2**30:.0f}"
                   if reuse != "chain" else "resident weights would not fit the GPU (memory audit)")
            notes.append(f"etp.gather_reuse auto -> {reuse}: {why}")
            return reuse
    return "chain"


def resolve_auto(recipe, machine: Machine, keep: tuple[str, ...] = ()):
    """``recipe`` with every ``auto`` key but those in ``keep`` (and an unset ``world_size``)
    chosen for ``machine``; returns ``(recipe, notes)``, one note per choice with its reason.
    See [Note: auto settings].

    Example::

        recipe, notes = resolve_auto(Recipe.from_yaml("recipes/moe_flagship.yaml"), Machine.detect())
    """
    held = [key for key in keep if key in recipe.auto]
    if held:  # resolve everything, then put the held keys back to auto
        resolved, notes = resolve_auto(recipe, machine)
        overrides = {k: "auto" for k in held if not k.startswith("etp.")}
        etp = {k[4:]: "auto" for k in held if k.startswith("etp.")}
        if etp:
            overrides["etp"] = etp
        return resolved.replace(**overrides), [n for n in notes if n.split(" ")[0] not in held]
    notes: list[str] = []
    if recipe.parallel.world_size is None:
        recipe = recipe.replace(world_size=machine.world_size)
    etp = _etp_sizes(recipe, machine, notes)
    if etp:
        recipe = recipe.replace(etp=etp)
    micro = _micro_batch(recipe, machine, notes)
    if micro is not None:
        recipe = recipe.replace(micro_batch_size=micro)
    graph = _cuda_graph(recipe, machine, notes)
    if graph is not None:
        recipe = recipe.replace(cuda_graph=graph)
    dtype = _gather_dtype(recipe, machine, recipe.train.cuda_graph == "step", notes)
    if dtype is not None:
        recipe = recipe.replace(etp={"gather_dtype": dtype})
    reuse = _gather_reuse(recipe, machine, notes)
    if reuse is not None:
        recipe = recipe.replace(etp={"gather_reuse": reuse})
    return recipe, notes
