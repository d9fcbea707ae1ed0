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
    threads: Optional[int] = opts.THREADS,
) -> None:
    """Pretrain a small Llama-family model from scratch and save it as a Hugging Face folder."""
    from ..train.pretrain import train

    opts.apply_threads(threads)
    train(out, size=size, steps=steps, resume=resume, corpus=corpus, tokenizer=tokenizer, batch_size=batch_size,
          grad_accum=grad_accum, lr=lr, seq_len=seq_len, device=device, seed=seed, eval_every=eval_every,
          save_every=save_every, vocab_size=vocab_size, warmup=warmup, bf16=bf16, save_dtype=save_dtype,
          stop_at=stop_at, command=command_line())


@user_errors
def distill_command(
    target: Optional[str] = opts.TARGET,
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
    k: int = opts.NUM_SPECULATIVE_TOKENS,  # the speculation length of the acceptance check
    device: Optional[str] = opts.DEVICE,
    seed: int = typer.Option(0, "--seed"),
    save_dtype: str = typer.Option("bfloat16", "--save-dtype", help="bfloat16 | float16 | float32."),
    bf16: Optional[bool] = typer.Option(None, "--bf16/--no-bf16", help="bf16 autocast (default: on CUDA only)."),
    teacher_dtype: str = typer.Option("float32", "--teacher-dtype", help="The target's dtype while distilling."),
    teacher_topk: int = typer.Option(0, "--teacher-topk",
                                     help="Precompute the target's top-k distributions once (0: the full "
                                          "distribution, computed at every step)."),
    teacher_windows: int = typer.Option(0, "--teacher-windows",
                                        help="Windows in the precomputed set (default steps x batch size)."),
    init: str = typer.Option("normal", "--init", help="normal | target-embedding (the target's, projected)."),
    instructions: Optional[bool] = typer.Option(None, "--instructions/--no-instructions",
                                                help="Train on the target's answers to chat instructions "
                                                     "(default: when the target has a chat template)."),
    eval_every: int = typer.Option(100, "--eval-every", help="Held-out loss every N steps (and at the end)."),
    save_every: int = typer.Option(0, "--save-every", help="Write the draft every N steps (0: at the end only)."),
    threads: Optional[int] = opts.THREADS,
) -> None:
    """Distil a small draft from a target (KL to the target's distributions), same tokenizer."""
    from ..llm import default_model_dirs
    from ..train.distill import distill

    opts.apply_threads(threads)
    distill(target or default_model_dirs()[0], out, size=size, steps=steps, corpus=corpus, batch_size=batch_size, seq_len=seq_len, lr=lr,
            generated_fraction=generated_fraction, pool_prompts=pool_prompts, pool_new_tokens=pool_new_tokens,
            eval_prompts=eval_prompts, k=k, device=device, seed=seed, save_dtype=save_dtype, bf16=bf16,
            teacher_dtype=teacher_dtype, teacher_topk=teacher_topk, teacher_windows=teacher_windows, init=init,
            instructions=instructions, eval_every=eval_every, save_every=save_every, command=command_line())


@user_errors
def train_eagle3_command(
    target: Optional[str] = opts.TARGET,
    out: Path = typer.Option(..., "--out", help="Output folder for the head."),
    prompts: int = typer.Option(256, "--prompts", help="Target answers / continuations generated for training."),
    new_tokens: int = typer.Option(128, "--new-tokens", help="Tokens per generated sequence (at most)."),
    epochs: int = typer.Option(4, "--epochs"),
    batch_size: int = typer.Option(8, "--batch-size", help="Windows per step."),
    seq_len: int = typer.Option(128, "--seq-len", help="Tokens per window."),
    lr: float = typer.Option(3e-3, "--lr", help="Peak learning rate (cosine schedule)."),
    ttt_steps: int = typer.Option(3, "--ttt-steps", help="Training-time-test steps (draft depths trained)."),
    draft_vocab: Optional[int] = typer.Option(None, "--draft-vocab",
                                              help="Draft vocabulary: the N most frequent target tokens "
                                                   "(default: the whole vocabulary)."),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat",
                                        help="Train on chat answers (default: when the target has a chat template)."),
    corpus_windows: int = typer.Option(64, "--corpus-windows",
                                       help="Windows of corpus text added to the target's own text."),
    resume: bool = typer.Option(False, "--resume", help="Continue from OUT/checkpoint.pt and OUT/sequences.json."),
    threads: Optional[int] = opts.THREADS,
    seed: int = typer.Option(0, "--seed"),
    bf16: Optional[bool] = typer.Option(None, "--bf16/--no-bf16",
                                        help="The head's forward and backward under bfloat16 autocast (default: "
                                             "where bfloat16 matmuls are fast: CUDA, AVX512-BF16 / AMX CPUs)."),
) -> None:
    """Train an EAGLE-3 head for a target (its own text, training-time test); use it with
    `--method eagle3 --draft OUT`."""
    from ..train.eagle3 import train_eagle3

    opts.apply_threads(threads)
    train_eagle3(target or _bundled_target(), out, prompts=prompts, new_tokens=new_tokens, epochs=epochs,
                 batch_size=batch_size, seq_len=seq_len, lr=lr, ttt_steps=ttt_steps, draft_vocab=draft_vocab,
                 chat=chat, seed=seed, corpus_windows=corpus_windows, resume=resume,
                 log=lambda entry: opts.err.print(entry), progress=True, bf16=bf16)


def _bundled_target():
    from ..llm import default_model_dirs

    return default_model_dirs()[0]
