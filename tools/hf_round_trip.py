#!/usr/bin/env python
"""A Hugging Face round trip at full width on one GPU: a random Qwen3-30B-A3B-shaped checkpoint
made by transformers (``--layers`` of its 48), imported with ``etp-convert import-hf``, evaluated
and fine-tuned by ``etp-train``, exported with ``etp-convert export-hf`` and loaded again by
transformers.

The two independent comparisons, each on the same samples (the global batch of iteration 0,
read by etp-train's own reader, ``etp.train.batches.Batches``):

* the import: etp-train's ``skip_train`` loss of the imported weights against transformers'
  loss of the original model;
* the export: etp-train's ``skip_train`` loss of the fine-tuned checkpoint against
  transformers' loss of the exported model (``AutoModelForCausalLM.from_pretrained``).

Each pair agrees within ``--tolerance`` (relative; both run in bf16 with their own kernels), and the
fine-tuned loss lies below the original's (differs from it, under ``--leave-alone``). Import and export run as their own processes: their
wall time and peak resident memory (``os.wait4``) are reported. Checkpoints are deleted once the
next stage no longer needs them; the fine-tune saves its weights alone (``no_save_optim``: 2 bytes a
parameter, not 14), so disk and save time allow more layers.

``--leave-alone`` fine-tunes the way a run left alone does (docs/multinode.md): on an indexed
dataset written by ``etp-preprocess`` (random-id documents, ``NullTokenizer``), validation loss
every 2 iterations, TensorBoard on, ``async_save`` every 2 iterations, ``exit_signal_handler``, and
``pretrained_checkpoint`` = the import with ``load`` = ``save``: once the log shows half the
iterations the workers get SIGTERM (what a preemption sends), the run must save and exit 0, and
the same command must resume from that save and finish. ``--gpus N`` runs every etp-train stage
on N GPUs (``auto``: ETP N within the host).

    python3 tools/hf_round_trip.py --layers 4 --out hf_round_trip.json
    python3 tools/hf_round_trip.py --gpus 4 --layers 8 --leave-alone --out hf_etp4.json
    python3 tools/hf_round_trip.py --cpu-smoke --out /tmp/hf.json   # a tiny Qwen3-MoE, 2 gloo ranks: checks the script
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_provenance import provenance  # noqa: E402

RECIPE = "recipes/qwen3_30b_a3b.yaml"
# Qwen3-30B-A3B's config.json (the published model's architecture), at fewer layers.
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-6,
                     max_position_embeddings=40960, tie_word_embeddings=False, decoder_sparse_step=1,
                     mlp_only_layers=[], initializer_range=0.02)
TINY = dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=256)
_SKIP_LOSS = re.compile(r"skip_train: loss ([\d.]+) of the loaded weights")


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun's workers), from /proc."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return found


def _high_water_kib(pid: int) -> int:
    """The process's peak resident set (``VmHWM``: its own, unlike ``ru_maxrss``, which a child
    inherits from the parent it was forked from)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


_ITER = re.compile(r"^iter\s+(\d+)/\d+ \| loss ([\d.]+)", re.M)


def _timed(command: list[str], log: Path, timeout: int, sigterm_after: int | None = None) -> dict:
    """Runs ``command`` (output to ``log``): its return code, wall seconds and peak RSS (GB, the
    largest ``VmHWM`` of the process and its descendants, read every 0.1 s). ``sigterm_after``:
    once the log shows that iteration, SIGTERM every descendant (the ranks; torchrun itself is
    left to see them exit)."""
    print(f"[hf_round_trip] {' '.join(command)}", flush=True)
    began = time.perf_counter()
    peak, signalled = {}, None
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        while proc.poll() is None:
            tree = _tree(proc.pid)
            for pid in tree:
                peak[pid] = max(peak.get(pid, 0), _high_water_kib(pid))
            if sigterm_after is not None and signalled is None:
                done = [int(i) for i, _ in _ITER.findall(log.read_text(errors="replace"))]
                if done and max(done) >= sigterm_after:
                    signalled = max(done)
                    for pid in tree[1:] or tree:  # the ranks (a CPU run's own ranks are its children too)
                        try:
                            os.kill(pid, signal.SIGTERM)
                        except ProcessLookupError:
                            pass
            if time.perf_counter() > began + timeout:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.1)
    seconds = time.perf_counter() - began
    text = log.read_text(errors="replace")
    result = {"command": " ".join(command), "rc": proc.returncode if proc.returncode is not None else "timeout",
              "wall_s": round(seconds, 1), "peak_rss_gb": round(max(peak.values(), default=0) * 1024 / 1e9, 2),
              "losses": {int(i): float(v) for i, v in _ITER.findall(text)}}
    if sigterm_after is not None:
        result["sigterm_at_iteration"] = signalled
    if result["rc"] != 0:
        result["error"] = "\n".join(line for line in text.splitlines() if "error" in line.lower())[-1500:]
        print(f"[hf_round_trip] FAILED rc {result['rc']} after {seconds:.0f} s:\n{text[-2000:]}", flush=True)
    else:
        print(f"[hf_round_trip]   rc 0 in {seconds:.0f} s, peak RSS {result['peak_rss_gb']} GB", flush=True)
    match = _SKIP_LOSS.search(text)
    if match:
        result["loss"] = float(match.group(1))
        print(f"[hf_round_trip]   etp-train's loss {result['loss']}", flush=True)
    return result


def _samples(recipe_sets: dict, samples: int):
    """The global batch of iteration 0 as etp-train reads it: [samples, seq + 1] ids."""
    import torch

    from etp.recipe import Recipe
    from etp.train.batches import Batches

    recipe = Recipe.from_yaml(str(ROOT / recipe_sets.pop("recipe")), **recipe_sets)
    batches = Batches(recipe, 0, torch.device("cpu"), samples)
    reads = [batches.get(0, i) for i in range(samples)]
    return torch.cat([torch.cat([b.tokens, b.labels[:, -1:]], dim=1) for b in reads])


def transformers_loss(model, ids, device) -> float:
    """Mean next-token cross entropy over every sample (one forward per sample: the logits of
    a 4096-token sample at Qwen3's vocabulary are 2.5 GB in fp32)."""
    import torch
    import torch.nn.functional as F

    total = 0.0
    with torch.no_grad():
        for row in ids:
            row = row.to(device)[None]
            logits = model(input_ids=row[:, :-1]).logits.float()
            total += float(F.cross_entropy(logits.view(-1, logits.shape[-1]), row[:, 1:].reshape(-1)))
    return total / ids.shape[0]


def _left_alone(tmp: Path, keys: dict, imported: Path, tuned: Path, smoke: bool) -> list[str]:
    """The fine-tune's keys under ``--leave-alone``: an indexed dataset of random ids below the
    vocabulary (``etp-preprocess``, ``NullTokenizer``), validation, TensorBoard (when installed),
    async saves every 2 iterations, the SIGTERM handler, and the import as ``pretrained_checkpoint``
    with ``load`` = ``save``; saves hold weights only (``no_save_optim``), so a resume takes a fresh
    optimizer (``no_load_optim``)."""
    import importlib.util

    from bench_run_costs import write_id_corpus

    vocab = keys.get("vocab_size", QWEN3_30B_A3B["vocab_size"])
    write_id_corpus(tmp / "corpus.jsonl", vocab, 200_000 if smoke else 4_000_000, 700)
    subprocess.run([sys.executable, "-m", "etp.train.preprocess_command", "--input", str(tmp / "corpus.jsonl"),
                    "--json-keys", "text", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab),
                    "--output-prefix", str(tmp / "corpus"), "--workers", "2"], check=True, cwd=ROOT)
    # data=synthetic clears the recipe's byte corpus: the recipe refuses data beside data_path
    pairs = ["data=synthetic", f"data_path={tmp / 'corpus'}_text_document", "tokenizer_type=NullTokenizer", "tokenizer_model=null",
             f"data_cache_path={tmp / 'cache'}", "split=90,10,0", "eval_interval=2", "eval_iters=1",
             f"pretrained_checkpoint={imported}", f"load={tuned}", "async_save=true", "save_interval=2",
             "exit_signal_handler=true", "no_load_optim=true"]
    if importlib.util.find_spec("tensorboard") is not None:
        pairs.append(f"tensorboard_dir={tmp / 'tensorboard'}")
    return [item for pair in pairs for item in ("--set", pair)]


def _left_alone_checks(logs: Path, tmp: Path, stages: dict, iters: int) -> dict:
    """What ``--leave-alone`` requires of its two launches of one command line."""
    first, second = stages["finetune_until_sigterm"], stages["finetune"]
    stopped = first.get("sigterm_at_iteration")
    texts = [(logs / f"{name}.log").read_text(errors="replace") for name in ("finetune_until_sigterm", "finetune")]
    resumed_from = re.search(r"holds iteration (\d+): resuming from it", texts[1])
    checks = {
        "first start fine-tuned from the import": "fine-tuning from pretrained_checkpoint=" in texts[0],
        "SIGTERM: saved and exited 0": stopped is not None and first["rc"] == 0 and "SIGTERM received" in texts[0],
        "the same command resumed from that save": resumed_from is not None and stopped is not None
        and int(resumed_from.group(1)) >= stopped,
        "it finished": second["rc"] == 0 and max(second.get("losses") or {0: 0}) == iters,
        "validation losses logged": "validation loss at iteration" in texts[0] + texts[1],
    }
    if (tmp / "tensorboard").exists():
        checks["TensorBoard events written"] = any((tmp / "tensorboard").rglob("events.out.tfevents.*"))
    return checks


class StageFailed(Exception):
    """A stage's process exited non-zero; the message is the stage's name."""


def _load_hf(path, device, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=6, help="fine-tuning iterations")
    parser.add_argument("--samples", type=int, default=4, help="the global batch (of seq_length tokens each)")
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per stage")
    parser.add_argument("--out", required=True)
    parser.add_argument("--gpus", type=int, default=1, help="GPUs of every etp-train stage (auto: ETP over them)")
    parser.add_argument("--leave-alone", action="store_true",
                        help="fine-tune on an indexed dataset with validation, TensorBoard, async saves, a SIGTERM "
                             "and the resume of the same command (pretrained_checkpoint, load = save)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="a tiny Qwen3-MoE on 2 gloo ranks in fp32: checks the script")
    args = parser.parse_args(argv)

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    smoke = args.cpu_smoke
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    arch = dict(TINY if smoke else QWEN3_30B_A3B, num_hidden_layers=args.layers)
    keys = {"num_layers": args.layers, "global_batch_size": max(args.samples, args.gpus), "micro_batch_size": 1}
    if smoke:
        keys.update(vocab_size=512, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                    kv_channels=16, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, seq_length=64,
                    max_position_embeddings=256, bf16=False, world_size=2, backend="gloo",
                    global_batch_size=2 * args.samples, micro_batch_size=1)
    sets = [item for key, value in keys.items() for item in ("--set", f"{key}={value}")]
    launcher = ([sys.executable, "-m", "etp.train"] if smoke else
                ["torchrun", "--standalone", f"--nproc-per-node={args.gpus}", "-m", "etp.train"])
    report = {"layers": args.layers, "architecture": arch, "recipe": RECIPE, "recipe_keys": keys, "stages": {},
              "provenance": provenance()}
    stages = report["stages"]
    out = Path(args.out)
    logs = out.with_name(out.stem + "_logs")
    logs.mkdir(parents=True, exist_ok=True)

    def timed(name, command, sigterm_after=None):
        stages[name] = _timed(command, logs / f"{name}.log", args.timeout, sigterm_after)
        out.write_text(json.dumps(report, indent=1))  # what ran so far survives a kill
        if stages[name]["rc"] != 0:
            # later stages would only report this one's missing output, and spend their time doing so
            raise StageFailed(name)
        return stages[name]

    try:
        with tempfile.TemporaryDirectory(prefix="hf_round_trip_", dir=os.environ.get("ETP_BENCH_TMP")) as tmp:
            tmp = Path(tmp)
            hf, imported, tuned, exported = tmp / "hf", tmp / "imported", tmp / "tuned", tmp / "exported"
            ids = _samples({"recipe": RECIPE, **keys}, keys["global_batch_size"])

            began = time.perf_counter()
            torch.manual_seed(0)
            with torch.device(device):
                model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**arch)).to(dtype).eval()
            params = sum(p.numel() for p in model.parameters())
            original_loss = transformers_loss(model, ids, device)
            model.save_pretrained(hf, max_shard_size="2GB")
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
            stages["make"] = {"params": params, "wall_s": round(time.perf_counter() - began, 1),
                              "transformers_loss": original_loss}
            print(f"[hf_round_trip] made {params / 1e9:.2f} B parameters; transformers' loss {original_loss:.5f}",
                  flush=True)

            convert = [sys.executable, "-m", "etp.train.convert_command"]
            timed("import", [*convert, "import-hf", "--hf", str(hf), "--recipe", RECIPE, "--out", str(imported), *sets])
            evaluate = ["--set", "finetune=true", "--set", "skip_train=true", "--set", "cuda_graph=none",
                        "--train-iters", "1"]
            timed("import_loss", [*launcher, "--recipe", RECIPE, *sets, "--set", f"load={imported}", *evaluate])
            save_keys = ["--set", f"save={tuned}", "--set", "no_save_optim=true",  # the export needs the weights
                         "--train-iters", str(args.iters), "--log-interval", "1", "--json", str(tmp / "finetune.json")]
            if args.leave_alone:
                fine_tune = [*launcher, "--recipe", RECIPE, *sets, *_left_alone(tmp, keys, imported, tuned, smoke),
                             *save_keys]
                timed("finetune_until_sigterm", fine_tune, sigterm_after=max(1, args.iters // 2))
                timed("finetune", fine_tune)
                report["leave_alone"] = _left_alone_checks(logs, tmp, stages, args.iters)
            else:
                timed("finetune", [*launcher, "--recipe", RECIPE, *sets, "--set", f"load={imported}", "--set",
                                   "finetune=true", *save_keys])
            if (tmp / "finetune.json").exists():
                run = json.loads((tmp / "finetune.json").read_text())
                stages["finetune"].update(losses=run["losses"], ms_per_iter=run["ms_per_iter"],
                                          peak_allocated_gib=run.get("peak_allocated_gib"))
            shutil.rmtree(imported, ignore_errors=True)
            shutil.rmtree(hf, ignore_errors=True)
            timed("tuned_loss", [*launcher, "--recipe", RECIPE, *sets, "--set", f"load={tuned}", *evaluate])
            timed("export", [*convert, "export-hf", "--checkpoint", str(tuned), "--recipe", RECIPE, "--out", str(exported),
                             *sets])
            shutil.rmtree(tuned, ignore_errors=True)
            began = time.perf_counter()
            model = _load_hf(exported, device, dtype)
            stages["reload"] = {"wall_s": round(time.perf_counter() - began, 1), "type": type(model).__name__,
                                "params": sum(p.numel() for p in model.parameters()),
                                "transformers_loss": transformers_loss(model, ids, device)}
            del model
    except StageFailed as failed:
        report["failed_stage"] = str(failed)
        print(f"[hf_round_trip] stopped: the {failed} stage failed ({logs / f'{failed}.log'})", flush=True)

    def rel(a, b):
        return None if a is None or b is None else abs(a - b) / abs(b)

    imp, tuned_etp = stages.get("import_loss", {}).get("loss"), stages.get("tuned_loss", {}).get("loss")
    reloaded = stages.get("reload", {}).get("transformers_loss")
    report["comparisons"] = {
        "import: etp skip_train vs transformers (original)": {"etp": imp, "transformers": original_loss,
                                                              "relative": rel(imp, original_loss)},
        "export: etp skip_train (fine-tuned) vs transformers (export)": {"etp": tuned_etp, "transformers": reloaded,
                                                                         "relative": rel(tuned_etp, reloaded)},
    }
    ok = all(c["relative"] is not None and c["relative"] <= args.tolerance for c in report["comparisons"].values())
    # The fine-tune lowers the loss of the samples it trained on; --leave-alone's trains on other data.
    ok = ok and reloaded is not None and (reloaded != original_loss if args.leave_alone else reloaded < original_loss)
    ok = ok and all(report.get("leave_alone", {}).values())
    report["passed"] = ok
    out.write_text(json.dumps(report, indent=1))
    print("| comparison | etp | transformers | relative |\n|---|---:|---:|---:|")
    for name, c in report["comparisons"].items():
        relative = "" if c["relative"] is None else f"{c['relative']:.2e}"
        print(f"| {name} | {c['etp']} | {c['transformers']} | {relative} |")
    for name in [name for name in ("import", "export") if name in stages]:  # a failed stage ends the run
        s = stages[name]
        print(f"{name}: rc {s['rc']}, {s['wall_s']} s, peak RSS {s['peak_rss_gb']} GB")
    print(f"{'passed' if ok else 'FAILED'}; wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
