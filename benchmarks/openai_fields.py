"""What logprobs, penalties and logit_bias cost (issue 18), measured side by side.

Two questions:
1. Requests that use none of these fields must not get slower: the same rows run on the code
   before issue 18 (`--baseline REV`, checked out into a temporary git worktree) and on this
   tree, in two worker processes driven in turn, so that both see the same machine load.
2. With the fields, the overhead per step: each field set against the same engine without it.

Rows: plain decoding and speculative decoding (the bundled pair: draft model, k 5) on the bundled
target (vocabulary 4096), and plain decoding on SmolLM2-135M (vocabulary 49152: logprobs and
penalties work over the whole vocabulary, so this is where they cost most). float32,
compile="aot" (--compile eager: eager steps), batch 1, greedy, eos ignored.

Each (model, row) block: a warm-up, then --repeats repeats; in a repeat every variant runs every
prompt, in an order rotated per repeat. Reported: decode tok/s (first token to last) as the
median over repeats; each variant's ratio to its reference as the median (min - max) of the
per-repeat ratios; target steps per run and the time per step, and the overhead per step (ms):
time per step with the field minus without, per repeat, median. Penalties and logit_bias change
the greedy text, and so how many drafts are accepted: their speed ratio includes that; the
per-step overhead does not. The machine's load (load average, other processes' CPU share) is
recorded.

    python benchmarks/openai_fields.py --baseline c136b05 --threads 1 --out-dir benchmarks/results
    python benchmarks/openai_fields.py --baseline '' --models bundled --prompts 1 --new-tokens 4 \
        --repeats 1 --compile eager --out-dir /tmp/x   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FIELDS = {
    "none": {},
    "logprobs5": {"logprobs": 5},
    "penalties": {"repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.5},
    "logit_bias": {"logit_bias": {i: (-1.0) ** i * 2.0 for i in range(3, 13)}},
    "all": {"logprobs": 5, "repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.5,
            "logit_bias": {i: (-1.0) ** i * 2.0 for i in range(3, 13)}},
}


# ---- the worker: one code version, driven over stdin/stdout (JSON lines) -----------------------

def worker(threads: int) -> None:
    import torch

    from quickdraft import LLM, SamplingParams

    torch.set_num_threads(threads)
    llms = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "load":
            llms[cmd["name"]] = LLM(**cmd["kwargs"])
            reply = {"ok": True}
        elif cmd["op"] == "encode":
            llm = llms[cmd["name"]]
            reply = {"prompts": [llm.encode_chat(p) if cmd["chat"] else llm.tokenizer.encode(p) for p in cmd["texts"]]}
        else:
            fields = dict(cmd["fields"])
            if "logit_bias" in fields:
                fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
            params = SamplingParams(temperature=0, max_tokens=cmd["n"], ignore_eos=True, **fields)
            first = final = None
            for out in llms[cmd["name"]].stream(cmd["prompt"], params):
                if first is None:
                    first = time.perf_counter()
                if out.finished:
                    final = out
            reply = {"seconds": time.perf_counter() - first, "ids": final.token_ids,
                     "steps": final.stats.num_steps}
        print(json.dumps(reply), flush=True)


class Worker:
    def __init__(self, code_root: Path, threads: int):
        env = dict(os.environ, PYTHONPATH=str(code_root), OMP_NUM_THREADS=str(threads))
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", "--threads", str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=code_root)

    def ask(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait()}")
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ---- the driver ------------------------------------------------------------------------------

def rows_for(model: str, compile: str | bool = "aot") -> dict[str, dict]:
    base = {"dtype": "float32", "compile": compile}
    if model == "bundled":
        target, draft = ROOT / "quickdraft/default_models/target", ROOT / "quickdraft/default_models/draft"
        return {"plain": {**base, "target": str(target), "method": "none"},
                "draft-k5": {**base, "target": str(target), "draft": str(draft), "num_speculative_tokens": 5}}
    return {"plain": {**base, "target": "smollm2", "method": "none"}}


def texts_for(model: str, n: int) -> tuple[list, bool]:
    sys.path.insert(0, str(ROOT))
    from quickdraft.bench.workloads import chat_requests, code_completion
    from quickdraft.train.corpus import load_corpus

    if model == "bundled":
        return code_completion(load_corpus(None).heldout, n), False
    return chat_requests(n), True


def main() -> None:
    from quickdraft.bench.hardware import steady_steps

    steady_steps()  # no background AOT build switching the steps mid-measurement
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--baseline", default="c136b05", help="the commit before issue 18 ('' = skip question 1)")
    ap.add_argument("--models", nargs="+", default=["bundled", "smollm2"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="openai_fields_cpu")
    ap.add_argument("--compile", choices=["aot", "eager"], default="aot",
                    help="every row's steps: AOT packages or eager (smoke tests)")
    args = ap.parse_args()
    if args.worker:
        return worker(args.threads)
    sys.path.insert(0, str(ROOT))
    from quickdraft.bench.hardware import cpu_model, cpu_seconds, loadavg, other_cpu_share, provenance, provenance_line

    tmp = None
    workers = {"new": Worker(ROOT, args.threads)}
    if args.baseline:
        tmp = Path(tempfile.mkdtemp(prefix="qd-baseline-"))
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tmp), args.baseline], check=True,
                       capture_output=True)
        workers["old"] = Worker(tmp, args.threads)
    blocks = []
    try:
        for model in args.models:
            texts, chat = texts_for(model, args.prompts)
            for row, kwargs in rows_for(model, "aot" if args.compile == "aot" else False).items():
                key = f"{model}/{row}"
                for w in workers.values():
                    w.ask(op="load", name=key, kwargs=kwargs)
                prompts = workers["new"].ask(op="encode", name=key, texts=texts, chat=chat)["prompts"]
                variants = [("new", f) for f in FIELDS] + ([("old", "none")] if "old" in workers else [])
                for who, f in variants:  # warm-up
                    workers[who].ask(op="run", name=key, prompt=prompts[0], n=8, fields=FIELDS[f])
                cpu0, t0, load0 = cpu_seconds(), time.perf_counter(), loadavg()
                secs = {v: [] for v in variants}
                steps = {v: 0 for v in variants}
                ids = {v: [] for v in variants}
                for r in range(args.repeats):
                    order = variants[r % len(variants):] + variants[:r % len(variants)]
                    total = dict.fromkeys(variants, 0.0)
                    for p in prompts:
                        for v in order:
                            out = workers[v[0]].ask(op="run", name=key, prompt=p, n=args.new_tokens, fields=FIELDS[v[1]])
                            total[v] += out["seconds"]
                            if r == 0:
                                steps[v] += out["steps"]
                                ids[v].append(out["ids"])
                    for v in variants:
                        secs[v].append(total[v])
                wall = time.perf_counter() - t0
                tokens = len(prompts) * (args.new_tokens - 1)
                result = {}
                for v in variants:
                    ref = ("new", "none") if v != ("new", "none") else ("old", "none") if "old" in workers else v
                    ratios = [b / a for a, b in zip(secs[v], secs[ref])]  # speed relative to the reference
                    overhead = [(a / steps[v] - b / steps[ref]) * 1e3 for a, b in zip(secs[v], secs[ref])]
                    result[f"{v[0]}:{v[1]}"] = {
                        "tokens_per_s": tokens / statistics.median(secs[v]), "reference": f"{ref[0]}:{ref[1]}",
                        "speed_vs_reference_median": statistics.median(ratios), "speed_vs_reference_min": min(ratios),
                        "speed_vs_reference_max": max(ratios), "overhead_ms_per_step_median": statistics.median(overhead),
                        "steps_per_run": steps[v] / len(prompts),
                        "ms_per_step": statistics.median(secs[v]) / steps[v] * 1e3,
                        "greedy_tokens_equal_reference": ids[v] == ids[ref] if FIELDS[v[1]].keys() <= {"logprobs"} else None}
                block = {"model": model, "row": row, "threads": args.threads, "rows": result, "seconds": wall,
                         "machine": {"loadavg_1m_before": load0 and load0[0], "loadavg_1m_after": (loadavg() or [None])[0],
                                     "other_cpu_share": other_cpu_share(cpu0, cpu_seconds(), wall)}}
                blocks.append(block)
                for name, r in result.items():
                    print(f"{key} {name}: {r['tokens_per_s']:.1f} tok/s, {r['speed_vs_reference_median']:.3f}x "
                          f"{r['reference']} ({r['speed_vs_reference_min']:.3f}-{r['speed_vs_reference_max']:.3f}), "
                          f"{r['overhead_ms_per_step_median']:+.2f} ms/step", flush=True)
                print(f"{key}: load {block['machine']}", flush=True)
    finally:
        for w in workers.values():
            w.close()
        if tmp is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmp)], capture_output=True)
    import torch

    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu": cpu_model(), "cores": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version(),
            "command": "python benchmarks/openai_fields.py " + " ".join(sys.argv[1:])}
    prov = provenance("cpu", args.threads)  # the driver's machine; the workers run on it too
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps({"meta": meta, "blocks": blocks, "provenance": prov}, indent=1))
    lines = [f"# {args.name}", "", provenance_line(prov), "", f"`{meta['command']}`; {meta['cpu']}, {meta['cores']} cores, torch {meta['torch']}, "
             f"{args.threads} thread(s), {args.new_tokens} new tokens, {args.prompts} prompts, {args.repeats} repeats.", "",
             "| model | row | variant | tok/s | speed vs reference (min-max) | reference | steps/run | ms/step | "
             "overhead ms/step | load |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for b in blocks:
        for name, r in b["rows"].items():
            share = b["machine"]["other_cpu_share"]
            lines.append(f"| {b['model']} | {b['row']} | {name} | {r['tokens_per_s']:.1f} | "
                         f"{r['speed_vs_reference_median']:.3f} ({r['speed_vs_reference_min']:.3f}-"
                         f"{r['speed_vs_reference_max']:.3f}) | {r['reference']} | {r['steps_per_run']:.1f} | "
                         f"{r['ms_per_step']:.2f} | {r['overhead_ms_per_step_median']:+.2f} | "
                         f"other CPU {share if share is None else f'{share:.0%}'} |")
    (args.out_dir / f"{args.name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
