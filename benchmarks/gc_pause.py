"""How long Python's garbage collector stops a server process: a full (generation 2) collection
in a process holding what `quickdraft serve` holds (the model, its tokenizer and grammar
vocabulary, FastAPI, uvicorn, the metrics), before and after the server's freeze_heap
(gc.freeze). A collection holds the GIL, so while it runs the engine thread takes no step and
every stream waits: its time is an inter-token gap.

    python benchmarks/gc_pause.py --target smollm2 --out-dir benchmarks/results --name gc_pause_cpu
    python benchmarks/gc_pause.py --repeats 1 --out-dir /tmp/x      # the bundled target, a smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path


def collections(repeats: int) -> list[float]:
    """Seconds of `repeats` full collections."""
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect(2)
        out.append(time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="a model name, folder or GGUF (default: the bundled target)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--name", default="gc_pause")
    args = ap.parse_args(argv)

    from quickdraft import LLM
    from quickdraft.bench.hardware import provenance, provenance_line
    from quickdraft.server.app import build_app
    from quickdraft.server.state import ServerState, freeze_heap

    llm = LLM(args.target, compile=False)  # (the steps' kind does not change what Python tracks)
    try:
        llm.engine.grammar_vocabulary()  # the server builds it at start-up
    except Exception:  # noqa: BLE001 - a model without an eos token: the server skips it too
        pass
    build_app(ServerState(lambda: llm, "model"))
    rows = {}
    for when in ("loaded", "after freeze_heap"):
        if when != "loaded":
            freeze_heap()
        times = collections(args.repeats)
        rows[when] = {"tracked_objects": len(gc.get_objects()), "frozen_objects": gc.get_freeze_count(),
                      "full_collection_ms_median": 1e3 * statistics.median(times),
                      "full_collection_ms_max": 1e3 * max(times)}
    result = {"target": args.target or "bundled", "repeats": args.repeats, "rows": rows,
              "provenance": provenance()}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# A full garbage collection in a server process ({result['target']})", "",
             "| process | tracked objects | frozen | full collection ms (median) | max |", "|---|---:|---:|---:|---:|"]
    for when, r in rows.items():
        lines.append(f"| {when} | {r['tracked_objects']:,} | {r['frozen_objects']:,} | "
                     f"{r['full_collection_ms_median']:.2f} | {r['full_collection_ms_max']:.2f} |")
    lines += ["", f"Medians of {args.repeats} `gc.collect(2)` calls.", "", provenance_line(result["provenance"])]
    (args.out_dir / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
