#!/usr/bin/env python
"""What the things around the step cost it: pairs of etp-train runs of one recipe that differ
in one thing, run back to back in one call, their steady ms/iter side by side.

Pairs (``--pairs``, comma-separated; default all):

* ``data_path``: megatron-core's ``GPTDataset`` over an indexed dataset written by
  ``etp-preprocess`` (random-id documents of log-normal lengths, ``NullTokenizer``) against
  synthetic ids (``data=synthetic``): the cost of reading data, as a fraction of the step.
* ``doc_mask``: the same indexed dataset at sequence 4096, ``reset_attention_mask`` +
  ``reset_position_ids`` (per-document causal attention) against plain causal attention.
* ``metrics``: TensorBoard (``tensorboard_dir``) and W&B offline (``wandb_project``) on, against
  off (both write etp's JSON-lines stream).
* ``save``: ``save_interval`` saves of a small model (``--save-set``) written synchronously
  against ``async_save``: per save, how long the step waited (etp-train's own line: a
  synchronous save's seconds, an async save's copy to host), and the steady ms/iter of each
  run (which excludes those waits, so a background writer that slows the steps shows there).

Each run is its own ``torchrun`` process; a failed run records its log's tail and the others
still run. Writes one JSON (``--out``) and prints a markdown table.

    python3 tools/bench_run_costs.py --out run_costs.json
    python3 tools/bench_run_costs.py --pairs metrics,save --iters 12 --out costs.json
    python3 tools/bench_run_costs.py --cpu-smoke --out /tmp/costs.json   # 2 gloo ranks, tiny recipe: checks the script
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_provenance import provenance  # noqa: E402

PAIRS = ("data_path", "doc_mask", "metrics", "save")
_SAVED_SYNC = re.compile(r"etp-train: saved iteration (\d+) to .* \(([\d.]+) s\)")
_SAVED_ASYNC = re.compile(r"etp-train: saving iteration (\d+) in the background \(async_save; the step waited ([\d.]+) s")


def write_id_corpus(path: Path, vocab: int, tokens: int, median_doc: int, seed: int = 0) -> int:
    """JSONL of documents of space-separated ids in ``[0, vocab - 1)`` (``vocab - 1`` is the
    ``NullTokenizer``'s end of document), log-normal lengths around ``median_doc``; returns
    the number of documents."""
    rng = random.Random(seed)
    docs = written = 0
    with open(path, "w") as f:
        while written < tokens:
            n = max(8, min(8 * median_doc, int(rng.lognormvariate(math.log(median_doc), 0.8))))
            f.write(json.dumps({"text": " ".join(str(rng.randrange(vocab - 1)) for _ in range(n))}) + "\n")
            written, docs = written + n, docs + 1
    return docs


def _train_command(args, extra: list[str], json_path: Path) -> list[str]:
    launcher = ["torchrun", "--standalone", f"--nproc-per-node={args.gpus}", "-m", "etp.train"]
    return [*launcher, "--recipe", args.recipe, "--train-iters", str(args.iters), "--log-interval", "1",
            "--json", str(json_path), *args.base_set, *extra]


def _sets(*pairs: str) -> list[str]:
    return [item for pair in pairs for item in ("--set", pair)]


def _run(args, name: str, extra: list[str], folder: Path, env: dict | None = None) -> dict:
    json_path, log_path = folder / f"{name}.json", args.logs / f"{name}.log"
    command = _train_command(args, extra, json_path)
    print(f"[run_costs] {name}: {' '.join(command)}", flush=True)
    began = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, timeout=args.timeout,
                                env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = time.perf_counter() - began
    text = log_path.read_text(errors="replace")
    result = {"name": name, "command": " ".join(command), "rc": rc, "wall_s": round(seconds, 1)}
    if rc != 0 or not json_path.exists():
        result["error"] = "\n".join(line for line in text.splitlines() if "error" in line.lower())[-1000:]
        result["log_tail"] = text[-2000:]
        print(f"[run_costs] {name}: FAILED (rc {rc}) after {seconds:.0f} s\n{text[-1500:]}", flush=True)
        return result
    report = json.loads(json_path.read_text())
    result.update(ms_per_iter=report["ms_per_iter"], tflops_per_rank=report["tflops_per_rank"],
                  peak_allocated_gib=report.get("peak_allocated_gib"), steady_iterations=report["steady_iterations"],
                  losses=report["losses"],
                  ms_per_iter_each=[r["ms_per_iter"] for r in report["log"]],
                  saves_sync_s=[float(s) for _, s in _SAVED_SYNC.findall(text)],
                  saves_async_wait_s=[float(s) for _, s in _SAVED_ASYNC.findall(text)])
    print(f"[run_costs] {name}: {result['ms_per_iter']:.1f} ms/iter in {seconds:.0f} s", flush=True)
    return result


def _ratio(a: dict, b: dict) -> float | None:
    if a.get("ms_per_iter") and b.get("ms_per_iter"):
        return a["ms_per_iter"] / b["ms_per_iter"] - 1
    return None


def run_pairs(args, folder: Path, report: dict) -> list[dict]:
    rows = report["rows"]
    corpus = None
    if {"data_path", "doc_mask"} & set(args.pairs):
        prefix = folder / "corpus"
        print(f"[run_costs] writing {args.corpus_tokens:,} tokens of random-id documents", flush=True)
        docs = write_id_corpus(folder / "corpus.jsonl", args.vocab, args.corpus_tokens, args.median_doc)
        subprocess.run([sys.executable, "-m", "etp.train.preprocess_command", "--input", str(folder / "corpus.jsonl"),
                        "--json-keys", "text", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(args.vocab),
                        "--output-prefix", str(prefix), "--workers", str(args.workers)], check=True, cwd=ROOT)
        corpus = {"documents": docs, "tokens": args.corpus_tokens, "median_document": args.median_doc,
                  "prefix": f"{prefix}_text_document"}
        indexed = _sets("data=synthetic", f"data_path={corpus['prefix']}", "tokenizer_type=NullTokenizer",
                        "tokenizer_model=null",
                        f"data_cache_path={folder / 'cache'}", "split=99,1,0", "eval_iters=0")
    for pair in args.pairs:
        if pair == "data_path":
            synthetic = _sets("data=synthetic", "data_path=null", "tokenizer_type=null", "tokenizer_model=null",
                              "data_cache_path=null")
            runs = [_run(args, "synthetic_ids", synthetic, folder),
                    _run(args, "indexed_dataset", indexed, folder)]
        elif pair == "doc_mask":
            long = _sets(f"seq_length={args.long_seq}", f"max_position_embeddings={args.long_seq}")
            runs = [_run(args, f"causal_s{args.long_seq}", indexed + long, folder),
                    _run(args, f"per_document_s{args.long_seq}",
                         indexed + long + _sets("reset_attention_mask=true", "reset_position_ids=true"), folder)]
        elif pair == "metrics":
            on = _sets(f"tensorboard_dir={folder / 'tb'}", "wandb_project=etp-bench", "wandb_exp_name=run_costs",
                       f"wandb_save_dir={folder / 'wandb'}")
            runs = [_run(args, "metrics_off", [], folder), _run(args, "metrics_on", on, folder,
                                                                {"WANDB_MODE": "offline"})]
        elif pair == "save":
            small = _sets(*args.save_set, f"save_interval={args.save_interval}")
            runs = []
            for name, extra in (("save_sync", []), ("save_async", _sets("async_save=true"))):
                target = folder / name
                runs.append(_run(args, name, small + extra + _sets(f"save={target}"), folder))
                subprocess.run(["rm", "-rf", str(target)], check=False)  # the disk holds one run's saves
        else:
            raise SystemExit(f"--pairs: unknown pair {pair!r}: choose from {', '.join(PAIRS)}")
        row = {"pair": pair, "runs": runs, "slowdown": _ratio(runs[1], runs[0])}
        if pair == "save":
            row["wait_s_per_save"] = {r["name"]: r.get("saves_sync_s") or r.get("saves_async_wait_s")
                                      for r in runs}
        rows.append(row)
        Path(args.out).write_text(json.dumps(report, indent=1))  # what ran so far survives a kill
    if corpus:
        rows.insert(0, {"pair": "corpus", **corpus})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| pair | run | ms/iter | TFLOP/s | peak GiB | waits per save (s) | vs first |", "|---|---|---:|---:|---:|---|---:|"]
    for row in rows:
        for i, r in enumerate(row.get("runs", ())):
            waits = r.get("saves_sync_s") or r.get("saves_async_wait_s") or []
            ms = f"{r['ms_per_iter']:.1f}" if r.get("ms_per_iter") else f"failed ({r['rc']})"
            tf = f"{r['tflops_per_rank']:.0f}" if r.get("tflops_per_rank") else ""
            peak = f"{r['peak_allocated_gib']:.1f}" if r.get("peak_allocated_gib") else ""
            vs = f"{row['slowdown']:+.1%}" if i == 1 and row.get("slowdown") is not None else ""
            lines.append(f"| {row['pair']} | {r['name']} | {ms} | {tf} | {peak} | "
                         f"{', '.join(f'{w:.2f}' for w in waits)} | {vs} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/moe_flagship.yaml")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--pairs", default=",".join(PAIRS))
    parser.add_argument("--iters", type=int, default=14)
    parser.add_argument("--long-seq", type=int, default=4096, help="the doc_mask pair's sequence length")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--corpus-tokens", type=int, default=4_000_000)
    parser.add_argument("--median-doc", type=int, default=700, help="median document length in tokens")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--save-interval", type=int, default=5)
    parser.add_argument("--save-set", nargs="*", default=["num_layers=2", "num_experts=16"],
                        help="recipe keys of the save pair's smaller model (a save of the flagship is 66 GB)")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per run")
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="2 gloo ranks on CPU, the tiny recipe, small corpus: checks the script, times nothing")
    args = parser.parse_args(argv)
    args.pairs = args.pairs.split(",")
    args.base_set = []
    if args.cpu_smoke:
        args.recipe, args.gpus, args.iters, args.long_seq = "recipes/tiny_moe_cpu.yaml", 2, 3, 128
        args.vocab, args.corpus_tokens, args.median_doc, args.workers = 512, 20_000, 60, 1
        args.save_interval, args.save_set = 2, []
        args.base_set = _sets("world_size=2", "backend=gloo", "eval_interval=1000")
    out = Path(args.out)
    args.logs = out.with_name(out.stem + "_logs")  # each run's log, kept
    args.logs.mkdir(parents=True, exist_ok=True)
    report = {"recipe": args.recipe, "gpus": args.gpus, "iters": args.iters, "rows": [], "provenance": provenance()}
    with tempfile.TemporaryDirectory(prefix="run_costs_", dir=os.environ.get("ETP_BENCH_TMP")) as tmp:
        rows = run_pairs(args, Path(tmp), report)
    out.write_text(json.dumps(report, indent=1))
    print(markdown(rows))
    print(f"wrote {args.out}")
    failed = [r["name"] for row in rows for r in row.get("runs", ()) if r.get("rc") != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
