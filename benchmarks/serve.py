"""Serving benchmark: plain decoding against speculative decoding under Poisson load.

For each configuration a real `quickdraft serve` process starts on a free port on
127.0.0.1 (bundled model pair), the driver waits for /health, runs `bench-serve`'s load
generator at each request rate (Poisson arrivals, held-out code prompts, greedy,
ignore_eos, a fixed number of output tokens), then stops the server. Configurations:
plain (`--method none`), draft with a fixed k, and draft with the goodput policy reading a
`quickdraft tune` profile. Writes JSON, a markdown table and a PNG of median TPOT and output
throughput against the request rate, and reports the crossover rate where speculation
stops paying (its median TPOT reaches plain decoding's).

    python benchmarks/serve.py --rates 1,2,4,8 --num-requests 24 --max-tokens 48
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from quickdraft.bench.hardware import cpu_model
from quickdraft.server.bench_serve import (LoadConfig, bench, check_server, crossover, load_prompts, parse_values,
                                           run_name)

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def row(label: str, r: dict, plain: dict | None) -> str:
    ms = lambda x: "-" if x is None else f"{1e3 * x:.1f}"  # noqa: E731
    f = lambda x, fmt=".2f": "-" if x is None else format(x, fmt)  # noqa: E731
    ratio = (r["tpot"]["median"] / plain["tpot"]["median"]) if plain and plain["tpot"]["median"] else None
    return (f"| {label} | {run_name(r)} | {r['completed']}/{r['errors']} | {f(r['request_throughput'])} | "
            f"{f(r['output_throughput'], '.1f')} | {ms(r['ttft']['median'])} / {ms(r['ttft']['p99'])} | "
            f"{ms(r['tpot']['median'])} / {ms(r['tpot']['p99'])} | {f(ratio)} | "
            f"{ms(r['itl']['median'])} / {ms(r['itl']['p99'])} | {ms(r['e2e']['median'])} / {ms(r['e2e']['p99'])} | "
            f"{f(r['spec']['acceptance_rate'], '.3f')} | {f(r['spec']['mean_acceptance_length'])} | "
            f"{f(r['loadavg_1m_before'], '.1f')} |")


def crossover_text(label: str, c: dict, rates: list[float]) -> str:
    if c["status"] == "crossed":
        return f"- {label}: stops paying at about {c['rate']:.1f} req/s (median TPOT reaches plain decoding's)"
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
          f"{s['date']}. Bundled model pair, one `quickdraft serve` process per configuration on this machine "
          f"({s['cpus']} CPUs, shared with the load generator), {s['num_requests']} requests per rate "
          f"(Poisson arrivals, seed {s['seed']}), held-out code prompts, greedy, {s['max_tokens']} output tokens "
          f"each (ignore_eos), {s['warmup']} warm-up requests per server. Latencies in ms as median / p99. "
          "TPOT = (E2E - TTFT) / (tokens - 1); ITL splits each streamed chunk's gap evenly over its tokens "
          f"(tokens per chunk: {', '.join(s['token_sources'])}). Load = 1-minute load average before the run.", "",
          "| config | rate | ok/err | req/s | out tok/s | TTFT | TPOT | TPOT / plain | ITL | E2E | acceptance | "
          "mean acc. length | load |", "|" + "---|" * 13]
    for c in result["configs"]:
        for r in c["runs"]:
            md.append(row(c["label"], r, plain.get(r["request_rate"])))
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="1,2,4,8", help="Poisson request rates (req/s), comma-separated")
    ap.add_argument("--num-requests", type=int, default=24, help="requests per rate")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("-k", type=int, default=4, help="k of the fixed-k draft configuration")
    ap.add_argument("--goodput-k", type=int, default=6, help="k bound of the goodput policy")
    ap.add_argument("--profile", type=Path, default=ROOT / "benchmarks/results/tune_default_pair_cpu.json")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--name", default="serve_cpu")
    args = ap.parse_args()
    rates = parse_values(args.rates, "--rates")
    configs = [("plain", ["--method", "none"]),
               (f"draft k={args.k}", ["--method", "draft", "-k", str(args.k)]),
               (f"draft goodput k<={args.goodput_k}", ["--method", "draft", "-k", str(args.goodput_k),
                                                         "--policy", "goodput", "--profile", str(args.profile)])]
    prompts, described = load_prompts("code", None, args.num_requests)
    t0 = time.monotonic()
    out = []
    for label, server_args in configs:
        server_args = [*server_args, "--max-num-seqs", str(args.max_num_seqs)]
        log = Path(tempfile.gettempdir()) / f"{args.name}_{len(out)}_{os.getpid()}.log"
        print(f"[{time.monotonic() - t0:5.0f} s] {label}: serve {' '.join(server_args)}", flush=True)
        with Server(server_args, log) as server:
            model = asyncio.run(check_server(server.url, None))
            cfgs = [LoadConfig(url=server.url, num_requests=args.num_requests, request_rate=r,
                               max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, model=model,
                               seed=args.seed) for r in rates]
            runs = bench(cfgs, prompts, warmup=args.warmup, progress=False)
        log.unlink(missing_ok=True)  # kept only when the server failed (SystemExit above)
        for r in runs:
            for q in r["requests"]:
                del q["itl"]  # per-token lists are summarized in r["itl"]; keep the file small
            print(f"[{time.monotonic() - t0:5.0f} s]   {run_name(r)}: {r['completed']}/{r['num_requests']} ok, "
                  f"median TPOT {1e3 * r['tpot']['median']:.1f} ms, {r['output_throughput']:.1f} tok/s", flush=True)
        out.append({"label": label, "server_args": server_args, "runs": runs})
    base = [r["tpot"]["median"] for r in out[0]["runs"]]
    for c in out[1:]:
        c["crossover"] = crossover(rates, base, [r["tpot"]["median"] for r in c["runs"]])
    import torch

    result = {"setup": {"hardware": cpu_model(), "cpus": os.cpu_count(), "torch": torch.__version__,
                        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        "rates": rates, "num_requests": args.num_requests, "max_tokens": args.max_tokens,
                        "warmup": args.warmup, "seed": args.seed, "prompts": described,
                        "token_sources": sorted({t for c in out for r in c["runs"] for t in r["token_sources"]}),
                        "wall_s": time.monotonic() - t0,
                        "command": "python benchmarks/serve.py " + " ".join(sys.argv[1:])},
              "configs": out}
    for p in write(result, args.out_dir, args.name):
        print(f"wrote {p}")
    print((args.out_dir / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
