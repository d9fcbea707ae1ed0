"""`quickdraft train`: the typer command over `pretrain.train`. Imports stay light here;
torch and the trainer load only when the command runs."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

import typer


def train_command(
    out: Path = typer.Option(..., "--out", help="Output folder: tokenizer, data cache, checkpoint, HF model."),
    size: Optional[str] = typer.Option(None, "--size", help="tiny | draft-xs | target-s (default target-s)."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Total optimizer steps (default 1000)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from OUT/checkpoint.pt."),
    corpus: Optional[Path] = typer.Option(None, "--corpus", help="Folder of text/code (default: Python's stdlib)."),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="Reuse the tokenizer in this folder."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Windows per micro-batch (default 16)."),
    grad_accum: Optional[int] = typer.Option(None, "--grad-accum", help="Micro-batches per step (default 1)."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak learning rate (default: per size)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per window (default 256)."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu | cuda | mps (default: best available)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Initial weights and data order (default 0)."),
    eval_every: int = typer.Option(100, "--eval-every", help="Held-out loss every N steps (and at the end)."),
    save_every: int = typer.Option(200, "--save-every", help="Checkpoint every N steps (and at the end)."),
    vocab_size: Optional[int] = typer.Option(None, "--vocab-size", help="Vocabulary (default: per size)."),
    warmup: Optional[int] = typer.Option(None, "--warmup", help="Warmup steps (default steps/20, at most 200)."),
    bf16: Optional[bool] = typer.Option(None, "--bf16/--no-bf16", help="bf16 autocast (default: on CUDA only)."),
    save_dtype: str = typer.Option("bfloat16", "--save-dtype", help="bfloat16 | float16 | float32."),
    stop_at: Optional[int] = typer.Option(None, "--stop-at", help="Stop after step N (resume later)."),
) -> None:
    """Pretrain a small Llama-family model from scratch and save it as a Hugging Face folder."""
    from .pretrain import train

    train(out, size=size, steps=steps, resume=resume, corpus=corpus, tokenizer=tokenizer, batch_size=batch_size,
          grad_accum=grad_accum, lr=lr, seq_len=seq_len, device=device, seed=seed, eval_every=eval_every,
          save_every=save_every, vocab_size=vocab_size, warmup=warmup, bf16=bf16, save_dtype=save_dtype,
          stop_at=stop_at, command=shlex.join(["quickdraft", *sys.argv[1:]]))
