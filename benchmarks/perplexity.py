"""A model's perplexity on this repository's docs in each weight format: what a format's rounding
(weights, and the int8 / int4 kernels' int8 activations) costs the model. One forward pass over
the first --tokens tokens of docs/*.md (sorted, concatenated), float32 log-softmax, mean
negative log-likelihood of each next token; one thread.

    python benchmarks/perplexity.py --model smollm2 --formats none,int8,int4 --tokens 1024 \
        --out benchmarks/results/perplexity_smollm2_cpu.txt
    python benchmarks/perplexity.py --tiny     # a smoke test: the bundled draft, 64 tokens, int8

With --kv-cache-dtypes the model reads its keys and values from a KV cache of each type instead
(filled in chunks of --chunk tokens, every chunk's logits scored: what decoding sees), beside the
one forward pass (a float32 cache gives its figure), over each of --texts (globs under the
repository root):

    python benchmarks/perplexity.py --model smollm2 --formats int4 --tokens 3072 \
        --kv-cache-dtypes float32,float16,bfloat16 --texts "docs/*.md,quickdraft/*.py,benchmarks/results/*.md"
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from quickdraft.bench.hardware import loadavg, provenance, provenance_line
from quickdraft.cache import KVCache
from quickdraft.model.loader import checkpoint_dir, load_model
from quickdraft.model import quant
from quickdraft.model.quant import prepare
from quickdraft.model.sources import BUNDLED_DIR, resolve_model
from quickdraft.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def perplexity(model: torch.nn.Module, ids: list[int]) -> float:
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))[0].float()  # (T, V)
    nll = -torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])
    return math.exp(nll.double().mean().item())


def cached_perplexity(model, ids: list[int], dtype: torch.dtype, chunk: int) -> float:
    """The same, the keys and values read from a KV cache of `dtype` filled `chunk` tokens at a time."""
    model.kv_cache_dtype = None if dtype == model.dtype else dtype
    rows = KVCache.for_model(model, 1, len(ids) + 1).rows(0, 1)
    nll = []
    with torch.inference_mode():
        for s in range(0, len(ids) - 1, chunk):
            part = ids[s:s + chunk]
            logits = model(torch.tensor([part]), torch.arange(s, s + len(part))[None], rows,
                           logits_at=torch.arange(len(part))[None], kv_len=s + len(part))[0].float()
            targets = torch.tensor(ids[s + 1:s + len(part) + 1])
            nll.append(-torch.log_softmax(logits[:len(targets)], dim=-1).gather(1, targets[:, None]).double())
    model.kv_cache_dtype = None
    return math.exp(torch.cat(nll).mean().item())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="a catalogue name, bundled model or folder")
    p.add_argument("--formats", default="none,int8,int4", help="quantizations, comma-separated (none: float32; "
                   "int4-super: int4 in the kernel's super-block layout where it fits, not the float16 one)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--kv-cache-dtypes", default=None,
                   help="comma-separated KV cache types (float32, float16, bfloat16): score through a cache of each")
    p.add_argument("--texts", default="docs/*.md", help="comma-separated globs under the repository root")
    p.add_argument("--chunk", type=int, default=128, help="tokens per forward when scoring through a cache")
    p.add_argument("--out", type=Path, default=None, help="also write the table to this text file")
    p.add_argument("--tiny", action="store_true", help="a smoke test: the bundled draft, 64 tokens, int8")
    args = p.parse_args()
    if args.tiny:
        args.model, args.formats, args.tokens = str(BUNDLED_DIR / "draft"), "int8", 64
    torch.set_num_threads(1)
    load_before = loadavg()
    path = checkpoint_dir(resolve_model(args.model))  # (a GGUF: its folder, tokenizer included)
    tok = Tokenizer.from_dir(path)
    texts = {g: tok.encode("\n\n".join(f.read_text() for f in sorted(ROOT.glob(g))))[:args.tokens]
             for g in args.texts.split(",")}
    how = "one forward pass" + (f", then through a KV cache filled {args.chunk} tokens at a time" if args.kv_cache_dtypes else "")
    lines = [f"# {args.model}: perplexity over the first {args.tokens} tokens of each text, {how}, 1 thread"]
    for fmt in args.formats.split(","):
        quantization = {"none": None, "int4-super": "int4"}.get(fmt, fmt)
        with quant.int4_super_blocks(fmt == "int4-super"):
            model = prepare(load_model(path, dtype=torch.float32, quantization=quantization), quantization)
        for g, ids in texts.items():
            for kv in [None] + (args.kv_cache_dtypes.split(",") if args.kv_cache_dtypes else []):
                t = time.perf_counter()
                ppl = perplexity(model, ids) if kv is None else cached_perplexity(model, ids, getattr(torch, kv),
                                                                                  args.chunk)
                lines.append(f"{fmt:5s} {g}" + ("" if kv is None else f" kv {kv}")
                             + f" perplexity {ppl:.3f}  ({len(ids)} tokens, {time.perf_counter() - t:.1f} s)")
                print(lines[-1], flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        header = f"# {provenance_line(provenance('cpu', 1, load_before=load_before))}"
        args.out.write_text("\n".join([header] + lines) + "\n")


if __name__ == "__main__":
    main()
