"""README's first command, run as a user runs it: `quickdraft generate --example NAME --compare`
in a fresh process each time, what it prints recorded (the speedup over plain decoding it measures
itself, whether the greedy output was identical, the acceptance, the text's first line).

The examples run alternately (edit, chat, edit, chat, ...: a change in the machine's load hits
both alike), --runs times each; the process is pinned to --cores (its children inherit it) and
torch uses --threads threads. Medians per example over the runs. --quantizations runs each
example once per value in the same alternation (default: the command as README gives it; none,
int8, int4: with `--quantization VALUE`), so the default's tok/s stands beside another format's;
--ks likewise runs each example once per k (default: the command's own; a number: with `-k K`), and
--kv-cache-dtypes once per KV cache type (default: the command's own; with `--kv-cache-dtype VALUE`).

    python benchmarks/first_command.py --target smollm2 --method suffix --examples edit chat --runs 3
    python benchmarks/first_command.py --examples edit chat --quantizations default none --runs 3
    python benchmarks/first_command.py --target smollm2 --method suffix --ks default 8 12 --runs 3
    python benchmarks/first_command.py --kv-cache-dtypes default float32 --threads 2 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quickdraft.bench.hardware import loadavg, provenance, provenance_line

SPEEDUP = re.compile(r"speedup over plain decoding: ([0-9.]+)x \(plain ([0-9.]+) tok/s, (\w+) steps; output identical to plain "
                     r"decoding: (yes|NO)\)")
STATS = re.compile(r"(\d+) tokens, ([0-9.]+) tok/s, acceptance rate ([0-9.]+), mean acceptance length ([0-9.]+)")


def label(example: str, quantization: str, k: str = "default", kv: str = "default") -> str:
    return (example + ("" if quantization == "default" else f", --quantization {quantization}")
            + ("" if k == "default" else f", -k {k}") + ("" if kv == "default" else f", --kv-cache-dtype {kv}"))


def run_once(args, example: str, quantization: str = "default", k: str = "default", kv: str = "default") -> dict:
    cmd = [sys.executable, "-m", "quickdraft.cli", "generate", "--example", example, "--temperature", "0",
           "--compare", "--threads", str(args.threads)]
    if quantization != "default":
        cmd += ["--quantization", quantization]
    if k != "default":
        cmd += ["-k", k]
    if kv != "default":
        cmd += ["--kv-cache-dtype", kv]
    if args.target:
        cmd += ["--target", args.target]
    if args.method:
        cmd += ["--method", args.method]
    if args.max_tokens:
        cmd += ["--max-tokens", str(args.max_tokens)]
    env = dict(os.environ)
    if args.fresh_cache:  # an empty cache of its own: kernels, the model's files and compiled steps made anew
        env["QUICKDRAFT_CACHE"] = tempfile.mkdtemp(prefix="quickdraft-first-command-")
        env.pop("QUICKDRAFT_KERNEL_CACHE", None)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    m, s = SPEEDUP.search(p.stderr), STATS.search(p.stderr)
    if m is None or s is None:
        raise SystemExit(f"no speedup / stats line in the output of {' '.join(cmd)}:\n{p.stderr}")
    text = p.stdout.strip()
    return {"example": label(example, quantization, k, kv), "speedup": float(m.group(1)), "plain_tokens_per_s": float(m.group(2)),
            "steps": m.group(3), "identical": m.group(4) == "yes", "tokens": int(s.group(1)), "tokens_per_s": float(s.group(2)),
            "acceptance_rate": float(s.group(3)), "mean_acceptance_length": float(s.group(4)),
            "wall_s": wall, "load_after": loadavg(), "text_start": text[:400]}


def markdown(result: dict) -> str:
    cmd = result["generate"]
    lines = [f"# README's first command: {cmd}", "", provenance_line(result["provenance"]), "",
             f"Command: `{result['provenance']['command']}`", "",
             f"Each run is a fresh process ({'from an empty cache: kernels, model files and compiled steps made anew' if result.get('fresh_cache') else 'models cached, AOT steps as the engine finds them'}); the speedup is the "
             f"one the command prints (its own paired measurement of the same prompt with plain decoding). "
             f"Load average (1 min) before: {result['load_before'][0]}, after: {result['load_after'][0]} "
             "(2 cores, shared with other work; one core pinned).", "",
             "| example | runs: speedup printed (steps timed) | median | tok/s (plain tok/s), medians | output = plain | "
             "acceptance rate | mean acceptance length | tokens | wall s per run |",
             "|---|---|---|---|---|---|---|---|---|"]
    for ex, s in result["summary"].items():
        runs = [r for r in result["runs"] if r["example"] == ex]
        printed = ", ".join(f"{r['speedup']:.2f}x ({r['steps']})" for r in runs)
        walls = ", ".join(f"{r['wall_s']:.0f}" for r in runs)
        speed = (f"{s['median_tokens_per_s']:.1f} ({s['median_plain_tokens_per_s']:.1f})"
                 if "median_tokens_per_s" in s else "-")  # (results before these medians have none)
        lines.append(f"| {ex} | {printed} | **{s['median_speedup']:.2f}x** | {speed} | "
                     f"{'yes' if s['all_identical'] else 'NO'} | {s['median_acceptance_rate']:.2f} | "
                     f"{s['median_acceptance_length']:.2f} | {runs[0]['tokens']} | {walls} |")
    lines += ["", "The text each example printed (first run, its start):", ""]
    for ex in result["summary"]:
        r = next(r for r in result["runs"] if r["example"] == ex)
        lines += [f"{ex}:", "", "~~~", r["text_start"], "~~~", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--method", default="suffix")
    ap.add_argument("--examples", nargs="+", default=["edit", "chat"])
    ap.add_argument("--quantizations", nargs="+", default=["default"],
                    help="default (README's command as it is), none, int8, int4: one run of each per example")
    ap.add_argument("--ks", nargs="+", default=["default"],
                    help="default (the command's own k), or numbers: one run with `-k K` of each per example")
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["default"],
                    help="KV cache types to run each example with: default (the command's own) or a --kv-cache-dtype value")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=None, help="default: each example's own")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cores", type=int, nargs="*", default=None)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default=None)
    ap.add_argument("--fresh-cache", action="store_true",
                    help="each run from an empty QUICKDRAFT_CACHE (a fresh machine, pip's own cache aside)")
    args = ap.parse_args()
    cores = args.cores or (sorted(os.sched_getaffinity(0))[:args.threads] if hasattr(os, "sched_getaffinity") else None)
    if cores:
        os.sched_setaffinity(0, cores)
    load_before = loadavg()
    runs = []
    for i in range(args.runs):
        for ex in args.examples:
            for q in args.quantizations:
                for k in args.ks:
                    for kv in args.kv_cache_dtypes:
                        runs.append(run_once(args, ex, q, k, kv))
                        print(f"[first_command] run {i + 1} {label(ex, q, k, kv)}: {runs[-1]['speedup']:.2f}x",
                              file=sys.stderr, flush=True)
    summary = {}
    for ex in [label(e, q, k, kv) for e in args.examples for q in args.quantizations for k in args.ks
               for kv in args.kv_cache_dtypes]:
        rs = [r for r in runs if r["example"] == ex]
        summary[ex] = {"median_speedup": statistics.median(r["speedup"] for r in rs),
                       "all_identical": all(r["identical"] for r in rs),
                       "median_acceptance_rate": statistics.median(r["acceptance_rate"] for r in rs),
                       "median_acceptance_length": statistics.median(r["mean_acceptance_length"] for r in rs),
                       "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                       "median_plain_tokens_per_s": statistics.median(r["plain_tokens_per_s"] for r in rs)}
    generate = (f"quickdraft generate --target {args.target} --method {args.method} --example NAME --temperature 0 "
                "--compare")
    result = {"generate": generate, "runs": runs, "summary": summary, "load_before": load_before,
              "fresh_cache": args.fresh_cache,
              "load_after": loadavg(), "provenance": provenance("cpu", threads=args.threads, load_before=load_before)}
    name = args.name or f"first_command_{args.target}_cpu"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / f"{name}.md").write_text(markdown(result))
    print((args.out_dir / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
