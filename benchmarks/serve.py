"""Serving benchmark: plain decoding against speculative decoding under Poisson load.

A real `quickdraft serve` process per configuration starts on a free port on 127.0.0.1
(bundled model pair); once all answer /health, `bench-serve`'s load generator runs at each
request rate (Poisson arrivals, held-out code prompts, greedy, ignore_eos, a fixed number
of output tokens) against each server in turn, in a rotating order, so that other load on
the machine falls on all configurations alike; then the servers stop. Configurations:
plain (`--method none`), draft with a fixed k, and draft with the goodput policy reading a
`quickdraft tune` profile. Writes JSON, a markdown table and a PNG of median TPOT and output
throughput against the request rate, and reports the crossover rate where speculation
stops paying (its median TPOT reaches plain decoding's).

    python benchmarks/serve.py --rates 1,2,4,8,16,32,64 --num-requests 48 --max-tokens 48 --max-model-len 1024
    python benchmarks/serve.py --rates 1,2,4,8,16,32,64 --num-requests 48 --max-tokens 48 \
        --name serve_cpu_dynamic_cache
    python benchmarks/serve.py --rates 4 --num-requests 2 --max-tokens 4 --warmup 0 --max-num-seqs 2 \
        --profile PROFILE.json --out-dir /tmp/x       # a smoke test

(--max-model-len caps the servers' request length; their KV caches grow as requests arrive,
within the KV memory budget, and are freed when idle: docs/server.md, "KV memory". Results
named *_dynamic_cache predate that: they measured a server that sized its cache for the
requests waiting when it was last idle.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from quickdraft.bench.hardware import cpu_model, loadavg, provenance, provenance_line
from quickdraft.bench.serve_load.client import LoadConfig, bench, check_server, load_prompts, run_name
from quickdraft.bench.serve_load.launch import free_port
from quickdraft.bench.serve_load.stats import crossover
from quickdraft.cli.common import parse_values

ROOT = Path(__file__).resolve().parents[1]


class Server:
    """`python -m quickdraft.cli serve ARGS` on 127.0.0.1:free port, stopped on exit."""

    def __init__(self, args: list[str], log: Path, timeout: float = 300.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.log_path = log
        self.timeout = timeout

    def __enter__(self) -> "Server":
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "quickdraft.cli", "serve", "--host", "127.0.0.1",
                                      "--port", str(self.port), "--log-level", "warning", *self.args],
                                     cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"server {self.args} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise SystemExit(f"server {self.args} not ready after {self.timeout} s; see {self.log_path}")
            time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def cpu_seconds(pids: list[int]) -> tuple[float, float] | None:
    """(CPU seconds the whole machine has been busy, CPU seconds used by `pids`) from /proc,
    or None off Linux. Their difference over a run is the work of other processes."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
        mine = 0
        for pid in pids:
            stat = open(f"/proc/{pid}/stat").read()
            rest = stat[stat.rindex(")") + 2:].split()
            mine += int(rest[11]) + int(rest[12])  # utime, stime (all threads)
        return busy / tick, mine / tick
    except (OSError, ValueError, IndexError):
        return None


def add_crossovers(configs: list[dict], rates: list[float]) -> None:
    """Each speculative configuration's crossover against the first (plain), on median TPOT."""
    base = [r["tpot"]["median"] for r in configs[0]["runs"]]
    for c in configs[1:]:
        c["crossover"] = crossover(rates, base, [r["tpot"]["median"] for r in c["runs"]])


def compact(q: dict) -> dict:
    """A request's record for the results file: its timings (seconds, 5 decimals), tokens and
    error; its per-token ITLs are in the run's ITL summary."""
    out = {k: round(q[k], 5) if isinstance(q[k], float) else q[k]
           for k in ("index", "send_s", "ttft", "tpot", "e2e", "output_tokens", "num_chunks")}
    if q["error"]:
        out["error"] = q["error"]
    return out


def row(label: str, r: dict, plain: dict | None) -> str:
    ms = lambda x: "-" if x is None else f"{1e3 * x:.1f}"  # noqa: E731
    f = lambda x, fmt=".2f": "-" if x is None else format(x, fmt)  # noqa: E731
    ratio = (r["tpot"]["median"] / plain["tpot"]["median"]) if plain and plain["tpot"]["median"] else None
    return (f"| {label} | {run_name(r)} | {r['completed']}/{r['errors']} | {f(r['request_throughput'])} | "
            f"{f(r['output_throughput'], '.1f')} | {ms(r['ttft']['median'])} / {ms(r['ttft']['p99'])} | "
            f"{ms(r['tpot']['median'])} / {ms(r['tpot']['p99'])} | {f(ratio)} | "
            f"{ms(r['itl']['median'])} / {ms(r['itl']['p99'])} | {ms(r['e2e']['median'])} / {ms(r['e2e']['p99'])} | "
            f"{f(r['spec']['acceptance_rate'], '.3f')} | {f(r['spec']['mean_acceptance_length'])} | "
            f"{'-' if r.get('other_cpu_share') is None else format(100 * r['other_cpu_share'], '.0f') + '%'} |")


def crossover_text(label: str, c: dict, rates: list[float]) -> str:
    if c["status"] == "crossed":
        again = c.get("pays_again_at")
        return (f"- {label}: stops paying at about {c['rate']:.1f} req/s (median TPOT reaches plain decoding's)"
                + (f"; lower than plain's again at {', '.join(f'{r:g}' for r in again)} req/s" if again else ""))
    if c["status"] == "still-pays":
        return f"- {label}: lower median TPOT than plain decoding at every measured rate (up to {max(rates):g} req/s)"
    if c["status"] == "never-paid":
        return f"- {label}: no lower median TPOT than plain decoding even at {min(rates):g} req/s"
    return f"- {label}: no comparison (missing figures)"


def write(result: dict, out_dir: Path, name: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    s = result["setup"]
    json_path, md_path, png_path = (out_dir / f"{name}.{ext}" for ext in ("json", "md", "png"))
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    plain = {r["request_rate"]: r for r in result["configs"][0]["runs"]}
    md = [f"# Serving under Poisson load: plain vs speculative decoding ({s['hardware']})", "",
          *([provenance_line(result["provenance"]), ""] if "provenance" in result else []),
          f"{s['date']}. Bundled model pair, one `quickdraft serve` process per configuration on this machine "
          f"({s['cpus']} CPUs, shared with the load generator; idle servers sleep; at each rate the "
          "configurations run one after another in a rotating order), "
          f"{s['num_requests']} requests per rate "
          f"(Poisson arrivals, seed {s['seed']}), held-out code prompts, greedy, {s['max_tokens']} output tokens "
          f"each (ignore_eos), {s['warmup']} warm-up requests per server. Latencies in ms as median / p99. "
          "TPOT = (E2E - TTFT) / (tokens - 1); ITL splits each streamed chunk's gap evenly over its tokens "
          f"(tokens per chunk: {', '.join(s['token_sources'])}). Other CPU = CPU time used by other processes during the run (neither the servers nor the load generator), as a share of all CPUs: runs where it is well above 0 shared the machine and their latencies are inflated.", "",
          "| config | rate | ok/err | req/s | out tok/s | TTFT | TPOT | TPOT / plain | ITL | E2E | acceptance | "
          "mean acc. length | other CPU |", "|" + "---|" * 13]
    for c in result["configs"]:
        for r in c["runs"]:
            md.append(row(c["label"], r, plain.get(r["request_rate"])))
    if s.get("note"):
        md += ["", s["note"]]
    md += ["", "Servers:", ""] + [f"- {c['label']}: `quickdraft serve {' '.join(c['server_args'])}`"
                                  for c in result["configs"]]
    md += ["", "Crossover (median TPOT, interpolated between measured rates):", ""]
    md += [crossover_text(c["label"], c["crossover"], s["rates"]) for c in result["configs"][1:]]
    md += ["", f"Command: `{s['command']}`", ""]
    md_path.write_text("\n".join(md))
    paths = [json_path, md_path]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for c in result["configs"]:
        rates = [r["request_rate"] for r in c["runs"]]
        ax1.plot(rates, [1e3 * r["tpot"]["median"] for r in c["runs"]], marker="o", label=c["label"])
        ax2.plot(rates, [r["output_throughput"] for r in c["runs"]], marker="o", label=c["label"])
        if c.get("crossover", {}).get("status") == "crossed":
            ax1.axvline(c["crossover"]["rate"], ls="--", lw=0.8, color=ax1.lines[-1].get_color())
    ax1.set(xscale="log", xlabel="request rate (req/s, Poisson)", ylabel="median TPOT (ms)",
            title="time per output token (dashed: crossover)")
    ax2.set(xscale="log", xlabel="request rate (req/s, Poisson)", ylabel="output tokens/s",
            title="output throughput")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks(s["rates"], [f"{r:g}" for r in s["rates"]])
        ax.legend(fontsize=8)
    fig.suptitle(f"quickdraft serve, bundled pair, {s['max_tokens']} tokens/request ({s['hardware']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return paths + [png_path]


def main() -> None:
    from quickdraft.bench.hardware import steady_steps

    steady_steps()  # no background AOT build switching the steps mid-measurement
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="1,2,4,8", help="Poisson request rates (req/s), comma-separated")
    ap.add_argument("--num-requests", type=int, default=24, help="requests per rate")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("-k", type=int, default=4, help="k of the fixed-k draft configuration")
    ap.add_argument("--goodput-k", type=int, default=6, help="k bound of the goodput policy")
    ap.add_argument("--profile", type=Path, default=Path("benchmarks/results/tune_default_pair_cpu.json"),
                    help="goodput cost profile (relative to the repository root, where the servers run)")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="passed to the servers: the longest request (prompt + answer) they serve")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--name", default="serve_cpu")
    ap.add_argument("--from-json", type=Path, help="only rewrite the markdown and plot of saved results")
    ap.add_argument("--note", help="a paragraph for the markdown (kept in the JSON)")
    args = ap.parse_args()
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
        add_crossovers(result["configs"], result["setup"]["rates"])
        if args.note is not None:
            result["setup"]["note"] = args.note
        for p in write(result, args.out_dir, args.name):
            print(f"wrote {p}")
        return
    rates = parse_values(args.rates, "--rates")
    configs = [("plain", ["--method", "none"]),
               (f"draft k={args.k}", ["--method", "draft", "-k", str(args.k)]),
               (f"draft goodput k<={args.goodput_k}", ["--method", "draft", "-k", str(args.goodput_k),
                                                         "--policy", "goodput", "--profile", str(args.profile)])]
    prompts, described = load_prompts("code", None, args.num_requests)
    t0, load_before = time.monotonic(), loadavg()
    extra = ["--max-num-seqs", str(args.max_num_seqs)]
    if args.max_model_len is not None:
        extra += ["--max-model-len", str(args.max_model_len)]
    out = [{"label": label, "server_args": [*a, *extra], "runs": []} for label, a in configs]
    logs = [Path(tempfile.gettempdir()) / f"{args.name}_{i}_{os.getpid()}.log" for i in range(len(out))]
    with contextlib.ExitStack() as stack:
        # every server up at once (an idle one sleeps), the configurations interleaved at each
        # rate in a rotating order: background load on a shared machine then drifts over all
        # of them alike instead of favouring whichever ran during a quiet minute
        servers = []
        for c, log in zip(out, logs):
            print(f"[{time.monotonic() - t0:5.0f} s] {c['label']}: serve {' '.join(c['server_args'])}", flush=True)
            servers.append(stack.enter_context(Server(c["server_args"], log)))
        models = [asyncio.run(check_server(sv.url, None)) for sv in servers]
        for ri, rate in enumerate(rates):
            order = [(ri + i) % len(out) for i in range(len(out))]
            for ci in order:
                cfg = LoadConfig(url=servers[ci].url, num_requests=args.num_requests, request_rate=rate,
                                 max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, model=models[ci],
                                 seed=args.seed)
                pids = [os.getpid(), *(sv.proc.pid for sv in servers)]
                cpu0, w0 = cpu_seconds(pids), time.monotonic()
                (r,) = bench([cfg], prompts, warmup=args.warmup if ri == 0 else 0, progress=False)
                cpu1, wall = cpu_seconds(pids), time.monotonic() - w0
                # CPU the rest of the machine used meanwhile, as a share of all CPUs: when it is
                # not near 0 the run shared the machine with other work and its latencies are inflated
                r["other_cpu_share"] = ((cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])) / (wall * os.cpu_count()) \
                    if cpu0 and cpu1 else None
                r["requests"] = [compact(q) for q in r["requests"]]
                r["order"] = order.index(ci)
                out[ci]["runs"].append(r)
                print(f"[{time.monotonic() - t0:5.0f} s]   {out[ci]['label']} at {run_name(r)}: "
                      f"{r['completed']}/{r['num_requests']} ok, median TPOT {1e3 * r['tpot']['median']:.1f} ms, "
                      f"{r['output_throughput']:.1f} tok/s, other processes' CPU {100 * r['other_cpu_share']:.0f}%",
                      flush=True)
    for log in logs:
        log.unlink(missing_ok=True)  # kept only when a server failed (SystemExit in Server)
    add_crossovers(out, rates)
    import torch

    result = {"setup": {"hardware": cpu_model(), "cpus": os.cpu_count(), "torch": torch.__version__,
                        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        "rates": rates, "num_requests": args.num_requests, "max_tokens": args.max_tokens,
                        "warmup": args.warmup, "seed": args.seed, "prompts": described,
                        "token_sources": sorted({t for c in out for r in c["runs"] for t in r["token_sources"]}),
                        "wall_s": time.monotonic() - t0, "note": args.note,
                        "command": "python benchmarks/serve.py " + " ".join(sys.argv[1:])},
              "configs": out,
              # the servers inherit this environment, so torch's thread count here is theirs
              "provenance": provenance("cpu", torch.get_num_threads(), load_before=load_before)}
    for p in write(result, args.out_dir, args.name):
        print(f"wrote {p}")
    print((args.out_dir / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
