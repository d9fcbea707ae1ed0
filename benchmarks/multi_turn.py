"""Multi-turn chat, with and without prefix caching, paired: two `quickdraft serve` processes of the
same model (one with --no-enable-prefix-caching), and `quickdraft bench-serve --workload chat
--compare-url` sending every turn to the cached server, then the same turn to the uncached one.
The workload and its figures are bench-serve's (quickdraft.bench.serve_load.chat); this script
only starts and stops the two servers.

    python benchmarks/multi_turn.py --target smollm2 --turns 10 --conversations 2 --system-words 1000 \
        --threads 1 --name multi_turn_smollm2_cpu
    python benchmarks/multi_turn.py --target smollm2 --method suffix -k 4 --name multi_turn_suffix_cpu

    python benchmarks/multi_turn.py --method draft -k 4 --chat-template benchmarks/plain_chat_template.jinja \
        --name multi_turn_bundled_draft_cpu               # the bundled pair: acceptance with and without hits
    python benchmarks/multi_turn.py --target smollm2 --no-compare --conversations 64 --concurrency 64 \
        --turns 3 --name concurrent_chat_smollm2_cpu      # one server (caching on), its peak memory

Extra arguments after `--` go to bench-serve (e.g. `-- --client openai`). The servers' peak resident
memory (VmHWM) is added to the results.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from quickdraft.bench.serve_load.launch import free_port, start_server, stop_server, wait_ready

ROOT = Path(__file__).resolve().parents[1]


def server_args(args: argparse.Namespace, caching: bool) -> list[str]:
    out = ["--served-model-name", "model", "--method", args.method, "--policy", "fixed", "--log-level", "warning",
           "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
    for flag, value in (("--target", args.target), ("--draft", args.draft), ("-k", args.k),
                        ("--threads", args.threads), ("--max-num-batched-tokens", args.max_num_batched_tokens),
                        ("--chat-template", args.chat_template)):
        if value is not None:
            out += [flag, str(value)]
    if not args.compile:  # eager: no background AOT build competing with the measurement
        out.append("--no-compile")
    return out


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise SystemExit("no VmHWM in /proc (Linux only)")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target model (default: the bundled one)")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--method", default="none")
    ap.add_argument("-k", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chat-template", type=Path, default=None, help="for a model without one (the bundled pair: "
                    "benchmarks/plain_chat_template.jinja)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--compile", action="store_true", help="the servers' default steps (AOT packages when cached, "
                    "else eager while a background build runs) instead of eager steps")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--system-words", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--no-compare", dest="compare", action="store_false", help="only the server with caching")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--name", default="multi_turn_cpu")
    args = ap.parse_args(argv)
    ports = (free_port(), free_port())
    logs = [args.out_dir / f"{args.name}.{which}.log" for which in ("cached", "uncached")]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    files = [log.open("w") for log in logs[:1 + args.compare]]
    procs = [start_server(server_args(args, caching), port, log=f, threads=args.threads or 1)
             for caching, port, f in zip((True, False), ports, files)]
    ok = False
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for url, proc in zip(urls, procs):
            wait_ready(url, proc)
        compare = ["--compare-url", urls[1], "--compare-label", "prefix caching off"] if args.compare else []
        cmd = [sys.executable, "-m", "quickdraft.cli", "bench-serve", "--workload", "chat", "--url", urls[0],
               "--label", "prefix caching on", *compare, "--turns", str(args.turns),
               "--conversations", str(args.conversations),
               "--concurrency", str(args.concurrency), "--system-words", str(args.system_words),
               "--max-tokens", str(args.max_tokens), "--temperature", "0", "--out-dir", str(args.out_dir),
               "--name", args.name, *extra]
        subprocess.run(cmd, cwd=ROOT, check=True)
        peaks = [peak_rss_mib(p.pid) for p in procs]
        path = args.out_dir / f"{args.name}.json"
        result = json.loads(path.read_text())
        result["server_peak_rss_mib"] = dict(zip(("url", "compare_url"), peaks))
        # the command that reproduces the result is this script's (bench-serve's own is kept beside it)
        this = "python benchmarks/multi_turn.py " + shlex.join(sys.argv[1:])
        result["provenance"]["bench_serve_command"] = result["provenance"]["command"]
        result["provenance"]["command"] = this
        path.write_text(json.dumps(result, indent=1) + "\n")
        with (args.out_dir / f"{args.name}.md").open("a") as md:
            md.write(f"Run by `{this}`.\n\n")
            md.write("Servers' peak resident memory (VmHWM): "
                     + ", ".join(f"{n} {v:.0f} MiB" for n, v in result["server_peak_rss_mib"].items()) + ".\n")
        ok = True
    finally:
        for p in procs:
            stop_server(p)
        for f in files:
            f.close()
        for log in logs if ok else ():  # the servers' logs matter only when something failed
            log.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
