"""A model's perplexity on this repository's docs in each weight format: what a format's rounding
(weights, and the int8 / int4 kernels' int8 activations) costs the model. One forward pass over
the first --tokens tokens of docs/*.md (sorted, concatenated), float32 log-softmax, mean
negative log-likelihood of each next token; one thread.

    python benchmarks/perplexity.py --model smollm2 --formats none,int8,int4 --tokens 1024 \
        --out benchmarks/results/perplexity_smollm2_cpu.txt
    python benchmarks/perplexity.py --tiny     # a smoke test: the bundled draft, 64 tokens, int8
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from quickdraft.bench.hardware import loadavg, provenance, provenance_line
from quickdraft.model.loader import checkpoint_dir, load_model
from quickdraft.model.quant import prepare
from quickdraft.model.sources import BUNDLED_DIR, resolve_model
from quickdraft.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def perplexity(model: torch.nn.Module, ids: list[int]) -> float:
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))[0].float()  # (T, V)
    nll = -torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])
    return math.exp(nll.double().mean().item())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="a catalogue name, bundled model or folder")
    p.add_argument("--formats", default="none,int8,int4", help="quantizations, comma-separated (none: float32)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--out", type=Path, default=None, help="also write the table to this text file")
    p.add_argument("--tiny", action="store_true", help="a smoke test: the bundled draft, 64 tokens, int8")
    args = p.parse_args()
    if args.tiny:
        args.model, args.formats, args.tokens = str(BUNDLED_DIR / "draft"), "int8", 64
    torch.set_num_threads(1)
    load_before = loadavg()
    path = checkpoint_dir(resolve_model(args.model))  # (a GGUF: its folder, tokenizer included)
    text = "\n\n".join(f.read_text() for f in sorted((ROOT / "docs").glob("*.md")))
    ids = Tokenizer.from_dir(path).encode(text)[:args.tokens]
    lines = [f"# {args.model}: perplexity over the first {len(ids)} tokens of docs/*.md, one forward pass, 1 thread"]
    for fmt in args.formats.split(","):
        model = prepare(load_model(path, dtype=torch.float32, quantization=None if fmt == "none" else fmt),
                        None if fmt == "none" else fmt)
        t = time.perf_counter()
        ppl = perplexity(model, ids)
        lines.append(f"{fmt:5s} perplexity {ppl:.3f}  ({time.perf_counter() - t:.1f} s)")
        print(lines[-1], flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        header = f"# {provenance_line(provenance('cpu', 1, load_before=load_before))}"
        args.out.write_text("\n".join([header] + lines) + "\n")


if __name__ == "__main__":
    main()
