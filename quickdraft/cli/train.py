"""`quickdraft train` and `quickdraft distill`: the commands over quickdraft.train. Imports stay
light here; torch and the trainer load only when a command runs."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from . import common as opts
from .common import command_line, user_errors


@user_errors
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
    device: Optional[str] = opts.DEVICE,
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
    from ..train.pretrain import train

    train(out, size=size, steps=steps, resume=resume, corpus=corpus, tokenizer=tokenizer, batch_size=batch_size,
          grad_accum=grad_accum, lr=lr, seq_len=seq_len, device=device, seed=seed, eval_every=eval_every,
          save_every=save_every, vocab_size=vocab_size, warmup=warmup, bf16=bf16, save_dtype=save_dtype,
          stop_at=stop_at, command=command_line())


@user_errors
def distill_command(
    target: Path = typer.Option(..., "--target", help="Target model folder (Hugging Face format)."),
    out: Path = typer.Option(..., "--out", help="Output folder for the draft."),
    size: str = typer.Option("draft-xs", "--size", help="Draft size (see quickdraft.train.sizes)."),
    steps: int = typer.Option(600, "--steps", help="Optimizer steps."),
    corpus: Optional[Path] = typer.Option(None, "--corpus", help="Folder of text/code (default: Python's stdlib)."),
    batch_size: int = typer.Option(16, "--batch-size", help="Windows per step."),
    seq_len: int = typer.Option(256, "--seq-len", help="Tokens per window."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak learning rate (default: per size)."),
    generated_fraction: float = typer.Option(0.5, "--generated-fraction",
                                             help="Share of each batch from target-generated text."),
    pool_prompts: int = typer.Option(256, "--pool-prompts", help="Target continuations generated for training."),
    pool_new_tokens: int = typer.Option(192, "--pool-new-tokens", help="Tokens per generated continuation."),
    eval_prompts: int = typer.Option(32, "--eval-prompts", help="Held-out prompts for the acceptance check."),
    k: int = typer.Option(5, "-k", help="Draft tokens per step in the acceptance check."),
    device: Optional[str] = opts.DEVICE,
    seed: int = typer.Option(0, "--seed"),
    save_dtype: str = typer.Option("bfloat16", "--save-dtype", help="bfloat16 | float16 | float32."),
    bf16: Optional[bool] = typer.Option(None, "--bf16/--no-bf16", help="bf16 autocast (default: on CUDA only)."),
) -> None:
    """Distil a small draft from a target (KL to the target's distributions), same tokenizer."""
    from ..train.distill import distill

    distill(target, out, size=size, steps=steps, corpus=corpus, batch_size=batch_size, seq_len=seq_len, lr=lr,
            generated_fraction=generated_fraction, pool_prompts=pool_prompts, pool_new_tokens=pool_new_tokens,
            eval_prompts=eval_prompts, k=k, device=device, seed=seed, save_dtype=save_dtype, bf16=bf16,
            command=command_line())
