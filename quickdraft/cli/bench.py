"""`quickdraft bench`: compare speculative methods with plain decoding (the measuring is
quickdraft.bench.compare); writes JSON, markdown and plots."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Optional

import typer

from ..config import check_num_speculative_tokens
from ..errors import QuickdraftError
from . import common as opts
from .common import command_line, parse_floats, parse_ints, parse_spec_options, user_errors


@user_errors
def bench_command(
    target: Optional[str] = opts.TARGET,
    draft: Optional[str] = opts.DRAFT,
    method: Optional[list[str]] = opts.METHODS,
    spec_option: Optional[list[str]] = opts.SPEC_OPTION,
    batch_sizes: str = typer.Option("1", "--batch-sizes", help="Comma-separated batch sizes."),
    ks: str = typer.Option("2,4", "--ks", help="Comma-separated speculation lengths k (each as -k elsewhere)."),
    temperatures: str = typer.Option("0", "--temperatures", help="Comma-separated temperatures (each as "
                                     "--temperature elsewhere)."),
    workload: str = opts.WORKLOAD,
    prompts: Optional[Path] = opts.PROMPTS_FILE,
    num_prompts: int = typer.Option(4, "--num-prompts", help="Built-in workload: prompts."),
    new_tokens: int = typer.Option(64, "--new-tokens"),
    repeats: int = typer.Option(3, "--repeats"),
    iters: int = opts.iters_option(5),
    out_dir: Path = opts.OUT_DIR,
    name: str = typer.Option("bench", "--name"),
    peers: bool = typer.Option(False, "--peers", help="Also time transformers' generate, assisted generation and "
                                                      "prompt lookup (greedy, batch 1; needs transformers)."),
    tensor_parallel_size: int = opts.TENSOR_PARALLEL_SIZE,
    tensor_parallel_timeout: float = opts.TENSOR_PARALLEL_TIMEOUT,
    threads: Optional[int] = opts.THREADS,
) -> None:
    """Compare speculative methods with plain decoding; write JSON, markdown and plots."""
    import torch
    from rich.console import Console
    from rich.progress import Progress

    from ..bench.compare import run_bench, write_outputs
    from ..bench.hardware import device_name
    from ..bench.workloads import read_prompts
    from ..llm import default_model_dirs
    from ..sampling import check_field

    opts.apply_threads(threads)
    if target is None:
        target, default_draft = default_model_dirs()
        draft = draft or default_draft
    methods = list(method or ["draft"])
    if "draft" in methods and draft is None:
        raise QuickdraftError("method 'draft' needs --draft")
    bs, k_list = parse_ints(batch_sizes, "--batch-sizes"), list(parse_ints(ks, "--ks"))
    temps = parse_floats(temperatures, "--temperatures")
    if not k_list or not temps:
        raise QuickdraftError("--ks and --temperatures need at least one value each")
    for k in k_list:
        opts.checked(check_num_speculative_tokens, "--ks")(k)
    for t in temps:
        opts.checked(lambda v: check_field("temperature", v), "--temperatures")(t)
    if not bs or min(bs) < 1 or repeats < 1 or new_tokens < 2:
        raise QuickdraftError("batch sizes must be >= 1, repeats >= 1, new tokens >= 2")
    if prompts is not None:
        texts = read_prompts(prompts)
    else:
        from ..train.corpus import load_corpus
        from ..bench.workloads import code_completion, editing

        docs = load_corpus(None).heldout
        if workload == "code":
            texts = code_completion(docs, num_prompts)
        elif workload == "editing":
            texts = [e.text for e in editing(docs, num_prompts, excerpt_chars=400)]
        else:
            raise QuickdraftError(f"--workload must be code or editing, got {workload!r}")
    console = Console(stderr=True)
    skipped = None
    if peers:
        from ..bench.peers import transformers_missing

        skipped = transformers_missing()
        if skipped:
            print(f"--peers skipped: {skipped}", file=sys.stderr)
            peers = False
    total = len(temps) * len(bs) * repeats + (1 + repeats if peers else 0)
    with Progress(console=console) as bar:
        task = bar.add_task("bench", total=total)
        result = run_bench(target, draft, methods, parse_spec_options(spec_option), list(bs), k_list, temps, texts,
                           new_tokens, repeats, iters, progress=lambda: bar.advance(task), peers=peers,
                           llm_options=opts.tensor_parallel_args(tensor_parallel_size, tensor_parallel_timeout))
    if skipped:
        result["peers"] = {"skipped": skipped}
    result["setup"] = {"hardware": device_name("cuda" if torch.cuda.is_available() else "cpu"),
                       "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "tensor_parallel_size": tensor_parallel_size,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "command": command_line()}
    for p in write_outputs(result, out_dir, name):
        console.print(f"wrote {p}")
    print((out_dir / f"{name}.md").read_text())
