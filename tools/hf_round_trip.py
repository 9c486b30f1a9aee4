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
fine-tuned loss lies below the original's. Import and export run as their own processes: their
wall time and peak resident memory (``os.wait4``) are reported. Checkpoints are deleted once the
next stage no longer needs them; the fine-tune saves its weights alone (``no_save_optim``: 2 bytes a
parameter, not 14), so disk and save time allow more layers.

    python3 tools/hf_round_trip.py --layers 4 --out hf_round_trip.json
    python3 tools/hf_round_trip.py --cpu-smoke --out /tmp/hf.json   # a tiny Qwen3-MoE, 2 gloo ranks: checks the script
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
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


def _timed(command: list[str], log: Path, timeout: int) -> dict:
    """Runs ``command`` (output to ``log``): its return code, wall seconds and peak RSS (GB, the
    largest ``VmHWM`` of the process and its descendants, read every 0.1 s)."""
    print(f"[hf_round_trip] {' '.join(command)}", flush=True)
    began = time.perf_counter()
    peak = {}
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        while proc.poll() is None:
            for pid in _tree(proc.pid):
                peak[pid] = max(peak.get(pid, 0), _high_water_kib(pid))
            if time.perf_counter() > began + timeout:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.1)
    seconds = time.perf_counter() - began
    text = log.read_text(errors="replace")
    result = {"command": " ".join(command), "rc": proc.returncode if proc.returncode is not None else "timeout",
              "wall_s": round(seconds, 1), "peak_rss_gb": round(max(peak.values(), default=0) * 1024 / 1e9, 2)}
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
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="a tiny Qwen3-MoE on 2 gloo ranks in fp32: checks the script")
    args = parser.parse_args(argv)

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    smoke = args.cpu_smoke
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    arch = dict(TINY if smoke else QWEN3_30B_A3B, num_hidden_layers=args.layers)
    keys = {"num_layers": args.layers, "global_batch_size": args.samples, "micro_batch_size": 1}
    if smoke:
        keys.update(vocab_size=512, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                    kv_channels=16, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, seq_length=64,
                    max_position_embeddings=256, bf16=False, world_size=2, backend="gloo",
                    global_batch_size=2 * args.samples, micro_batch_size=1)
    sets = [item for key, value in keys.items() for item in ("--set", f"{key}={value}")]
    launcher = ([sys.executable, "-m", "etp.train"] if smoke else
                ["torchrun", "--standalone", "--nproc-per-node=1", "-m", "etp.train"])
    report = {"layers": args.layers, "architecture": arch, "recipe": RECIPE, "recipe_keys": keys, "stages": {},
              "provenance": provenance()}
    stages = report["stages"]
    out = Path(args.out)
    logs = out.with_name(out.stem + "_logs")
    logs.mkdir(parents=True, exist_ok=True)

    def timed(name, command):
        stages[name] = _timed(command, logs / f"{name}.log", args.timeout)
        out.write_text(json.dumps(report, indent=1))  # what ran so far survives a kill
        return stages[name]

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
        timed("finetune", [*launcher, "--recipe", RECIPE, *sets, "--set", f"load={imported}", "--set", "finetune=true",
                           "--set", f"save={tuned}", "--set", "no_save_optim=true",  # the export needs the weights
                           "--train-iters", str(args.iters), "--log-interval", "1",
                           "--json", str(tmp / "finetune.json")])
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
        if stages["export"]["rc"] == 0:
            began = time.perf_counter()
            model = _load_hf(exported, device, dtype)
            stages["reload"] = {"wall_s": round(time.perf_counter() - began, 1), "type": type(model).__name__,
                                "params": sum(p.numel() for p in model.parameters()),
                                "transformers_loss": transformers_loss(model, ids, device)}
            del model

    def rel(a, b):
        return None if a is None or b is None else abs(a - b) / abs(b)

    imp, tuned_etp = stages["import_loss"].get("loss"), stages["tuned_loss"].get("loss")
    reloaded = stages.get("reload", {}).get("transformers_loss")
    report["comparisons"] = {
        "import: etp skip_train vs transformers (original)": {"etp": imp, "transformers": original_loss,
                                                              "relative": rel(imp, original_loss)},
        "export: etp skip_train (fine-tuned) vs transformers (export)": {"etp": tuned_etp, "transformers": reloaded,
                                                                         "relative": rel(tuned_etp, reloaded)},
    }
    ok = all(c["relative"] is not None and c["relative"] <= args.tolerance for c in report["comparisons"].values())
    ok = ok and reloaded is not None and reloaded < original_loss
    report["passed"] = ok
    out.write_text(json.dumps(report, indent=1))
    print("| comparison | etp | transformers | relative |\n|---|---:|---:|---:|")
    for name, c in report["comparisons"].items():
        relative = "" if c["relative"] is None else f"{c['relative']:.2e}"
        print(f"| {name} | {c['etp']} | {c['transformers']} | {relative} |")
    for name in ("import", "export"):
        s = stages[name]
        print(f"{name}: rc {s['rc']}, {s['wall_s']} s, peak RSS {s['peak_rss_gb']} GB")
    print(f"{'passed' if ok else 'FAILED'}; wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
