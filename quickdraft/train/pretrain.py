"""Pretrain a Llama-family model from scratch: `quickdraft train`.

corpus -> tokenizer (trained on the train split, or reused) -> cached token streams ->
AdamW with linear warmup and cosine decay to 10% of the peak -> a Hugging Face folder.

Resuming is exact: the checkpoint holds the weights, the optimizer, the step and the RNG
states, and batch i is a pure function of (seed, i), so an interrupted run resumed with
--resume ends with the same weights as an uninterrupted one (bit for bit in float32 on
the same machine).
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..errors import QuickdraftError
from ..model.loader import resolve_device
from ..model.tokenizer import Tokenizer
from ..model.transformer import Transformer
from . import tokenizer as tok_mod
from .card import write_model_card
from .corpus import load_corpus
from .data import WindowSampler, cached_tokens, eval_windows, fingerprint
from .export import SAVE_DTYPES, hf_config, save_hf_folder
from .sizes import LEARNING_RATES, SIZES

CHECKPOINT = "checkpoint.pt"
WEIGHT_DECAY = 0.1  # on matrices only; norms and biases are not decayed
BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0  # max global grad norm
MIN_LR_RATIO = 0.1  # cosine decays to this fraction of the peak learning rate
LOSS_CURVE_POINTS = 200  # training_log.json keeps at most this many (bucket-averaged) points

# Arguments a resumed run must share with the run it continues (None = take the checkpoint's).
FIXED_ARGS = ("size", "corpus", "batch_size", "grad_accum", "lr", "seq_len", "seed", "vocab_size", "warmup")


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine to 10%."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    low = peak * MIN_LR_RATIO
    return low + 0.5 * (peak - low) * (1 + math.cos(math.pi * progress))


def init_weights(model: Transformer, std: float, seed: int) -> None:
    """normal(0, std) matrices, std / sqrt(2 * layers) for the projections that write into
    the residual stream (GPT-2), zero biases, unit norm weights. Drawn on the CPU from a
    private generator, so the initial weights are the same on every device."""
    gen = torch.Generator().manual_seed(seed)
    residual_std = std / math.sqrt(2 * len(model.model.layers))
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied head is listed once
            if p.dim() >= 2:
                s = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * s)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)


def make_optimizer(model: Transformer, lr: float, device: torch.device) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=1e-8, fused=device.type == "cuda")


def lm_loss(model: Transformer, batch: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy of a (B, T + 1) batch, in float32."""
    logits = model(batch[:, :-1])  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction=reduction)


@torch.no_grad()
def evaluate(model: Transformer, windows: torch.Tensor, batch_size: int, device: torch.device, bf16: bool) -> float:
    """Mean held-out loss per predicted token over the fixed windows."""
    model.eval()
    total, count = 0.0, 0
    for chunk in windows.split(batch_size):
        chunk = chunk.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            total += lm_loss(model, chunk, reduction="sum").item()
        count += chunk[:, 1:].numel()
    model.train()
    return total / count


def _resolve_args(given: dict[str, Any], saved: dict[str, Any] | None) -> dict[str, Any]:
    args = dict(saved or {})
    for key, value in given.items():
        if value is None:
            continue
        if saved is not None and key in FIXED_ARGS and saved.get(key) != value:
            raise QuickdraftError(f"--resume: the checkpoint was trained with {key}={saved.get(key)!r}, "
                                  f"not {value!r}; pass the same value or start a new folder")
        args[key] = value
    size = args.setdefault("size", "target-s")
    if size not in SIZES:
        raise QuickdraftError(f"unknown size {size!r}: choose one of {', '.join(SIZES)}")
    args.setdefault("corpus", "stdlib")
    args.setdefault("steps", 1000)
    for key, default in (("batch_size", 16), ("grad_accum", 1), ("seq_len", 256), ("seed", 0),
                         ("lr", LEARNING_RATES[size]), ("vocab_size", SIZES[size]["vocab_size"])):
        args.setdefault(key, default)
    args.setdefault("warmup", max(1, min(200, args["steps"] // 20)))
    for key in ("steps", "batch_size", "grad_accum", "seq_len", "vocab_size", "warmup"):
        if not isinstance(args[key], int) or isinstance(args[key], bool) or args[key] < 1:
            raise QuickdraftError(f"{key} must be a positive integer, got {args[key]!r}")
    if args["seed"] < 0:
        raise QuickdraftError(f"seed must be >= 0, got {args['seed']}")
    if not (math.isfinite(args["lr"]) and args["lr"] > 0):
        raise QuickdraftError(f"lr must be a positive number, got {args['lr']}")
    max_pos = SIZES[size]["max_position_embeddings"]
    if args["seq_len"] > max_pos:
        raise QuickdraftError(f"seq_len {args['seq_len']} exceeds the context length {max_pos} of size {size!r}")
    if args["vocab_size"] < tok_mod.MIN_VOCAB:
        raise QuickdraftError(f"vocab_size must be at least {tok_mod.MIN_VOCAB}, got {args['vocab_size']}")
    return args


def _model_vocab_size(folder: Path) -> int | None:
    """vocab_size from a model folder's config.json, None when there is none."""
    try:
        value = json.loads((folder / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_checkpoint(path: Path, model, optimizer, step: int, args, config, log, tokenizer_sha: str) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"format": 1, "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "rng": _rng_state(), "args": args, "config": config, "log": log,
                "tokenizer_sha256": tokenizer_sha}, tmp)
    tmp.replace(path)


def _loss_curve(losses: list[float]) -> list[list[float]]:
    """[step, mean loss] per bucket, at most LOSS_CURVE_POINTS buckets."""
    width = max(1, math.ceil(len(losses) / LOSS_CURVE_POINTS))
    return [[min(i + width, len(losses)), round(sum(losses[i:i + width]) / len(losses[i:i + width]), 5)]
            for i in range(0, len(losses), width)]


def train(out_dir: str | Path, *, size: str | None = None, steps: int | None = None, resume: bool = False,
          corpus: str | Path | None = None, tokenizer: str | Path | None = None, batch_size: int | None = None,
          grad_accum: int | None = None, lr: float | None = None, seq_len: int | None = None,
          device: str | None = None, seed: int | None = None, eval_every: int = 100, save_every: int = 200,
          vocab_size: int | None = None, warmup: int | None = None, bf16: bool | None = None,
          save_dtype: str = "bfloat16", eval_windows_max: int = 64, stop_at: int | None = None,
          verbose: bool = True, command: str | None = None) -> dict[str, Any]:
    """Train a model of a named size (see sizes.SIZES) into `out_dir` and return a summary.

    Arguments left as None take their defaults (size target-s, 1000 steps, batch 16 x 256
    tokens, the size's learning rate and vocabulary, the stdlib corpus), or on --resume the
    checkpoint's values. `stop_at` ends the run after that step with a checkpoint only (a
    later --resume continues); `bf16` None means bf16 autocast on CUDA, float32 elsewhere.
    """
    t_start = time.perf_counter()
    out = Path(out_dir).expanduser()
    ckpt_path = out / CHECKPOINT
    ckpt = None
    if resume:
        if not ckpt_path.is_file():
            raise QuickdraftError(f"--resume: no {CHECKPOINT} in {out}")
        try:
            ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        except Exception as exc:  # a truncated or foreign file
            raise QuickdraftError(f"cannot read {ckpt_path}: {exc}") from None
    elif ckpt_path.exists():
        raise QuickdraftError(f"{out} already has a {CHECKPOINT}: pass --resume to continue it, or choose a new --out")
    elif (out / "model.safetensors").exists():
        raise QuickdraftError(f"{out} already holds a model: choose a new --out")
    for name, value in (("eval_every", eval_every), ("save_every", save_every), ("eval_windows", eval_windows_max)):
        if value < 1:
            raise QuickdraftError(f"{name} must be a positive integer, got {value}")
    if save_dtype not in SAVE_DTYPES:
        raise QuickdraftError(f"save_dtype must be one of {', '.join(SAVE_DTYPES)}, got {save_dtype!r}")
    corpus_arg = None if corpus is None else str(Path(corpus).expanduser().resolve())
    if vocab_size is None and tokenizer is not None and ckpt is None:
        vocab_size = _model_vocab_size(Path(tokenizer).expanduser())  # a draft must match its target
    args = _resolve_args(dict(size=size, steps=steps, corpus=corpus_arg, batch_size=batch_size,
                              grad_accum=grad_accum, lr=lr, seq_len=seq_len, seed=seed,
                              vocab_size=vocab_size, warmup=warmup), ckpt and ckpt["args"])
    if stop_at is not None and stop_at < 1:
        raise QuickdraftError(f"stop_at must be a positive integer, got {stop_at}")
    dev = resolve_device(device)
    use_bf16 = (dev.type == "cuda" and torch.cuda.is_bf16_supported()) if bf16 is None else bf16
    say = print if verbose else (lambda *a, **k: None)

    # Corpus first: a bad --corpus is reported before anything is written.
    data = load_corpus(None if args["corpus"] == "stdlib" else args["corpus"])
    if not data.heldout:
        raise QuickdraftError(f"the corpus {data.source} has a single usable file; at least 2 are needed "
                              "(one is held out to measure the loss)")
    size_cfg = SIZES[args["size"]]
    out.mkdir(parents=True, exist_ok=True)
    tok_json = out / "tokenizer.json"
    tokenizer_time = 0.0
    if tokenizer is not None:
        src = Path(tokenizer).expanduser() / "tokenizer.json"
        if ckpt is not None and src.is_file() and _sha256(src) != ckpt["tokenizer_sha256"]:
            raise QuickdraftError(f"--resume: --tokenizer {tokenizer} differs from the checkpoint's tokenizer")
        tok_mod.copy_tokenizer(tokenizer, out)
    elif not tok_json.exists():
        say(f"training a {args['vocab_size']}-token BPE tokenizer on {len(data.train)} files ...")
        t0 = time.perf_counter()
        tok_mod.train_tokenizer([t for _, t in data.train], out, args["vocab_size"],
                                size_cfg["max_position_embeddings"])
        tokenizer_time = time.perf_counter() - t0
    if ckpt is not None and _sha256(tok_json) != ckpt["tokenizer_sha256"]:
        raise QuickdraftError(f"--resume: {tok_json} changed since the checkpoint was written")
    qd_tok = Tokenizer(out)
    bos, eos = qd_tok.bos_token_id, qd_tok.eos_token_id
    if bos is None or eos is None:
        raise QuickdraftError(f"the tokenizer in {out} names no bos_token / eos_token in tokenizer_config.json")
    if qd_tok.vocab_size > args["vocab_size"]:
        raise QuickdraftError(f"the tokenizer has {qd_tok.vocab_size} tokens, more than vocab_size "
                              f"{args['vocab_size']}: pass --vocab-size {qd_tok.vocab_size} or larger")
    config = hf_config(size_cfg, args["vocab_size"], bos, eos, qd_tok.token_to_id(tok_mod.PAD), save_dtype)

    # Token streams, cached in out/data/.
    t0 = time.perf_counter()
    streams = {}
    for split, docs in (("train", data.train), ("heldout", data.heldout)):
        streams[split] = cached_tokens(out / "data" / f"{split}.npy", fingerprint(tok_json, docs), qd_tok._tok,
                                       [t for _, t in docs], bos, eos)
    tokenize_time = time.perf_counter() - t0
    sampler = WindowSampler(streams["train"], args["seq_len"], args["batch_size"], args["seed"])
    heldout = eval_windows(streams["heldout"], args["seq_len"], eval_windows_max)

    model = Transformer(ModelConfig.from_hf(config))
    init_weights(model, config["initializer_range"], args["seed"])
    model.to(dev).train()
    optimizer = make_optimizer(model, args["lr"], dev)
    n_params = sum(p.numel() for p in model.parameters())
    log: dict[str, Any] = {"train_loss": [], "heldout_loss": [], "wall_time_s": 0.0, "train_time_s": 0.0,
                           "tokenizer_time_s": tokenizer_time}
    step = 0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        _set_rng_state(ckpt["rng"])
        step, log = ckpt["step"], ckpt["log"]
        del ckpt
    total = args["steps"]
    if step > total:
        raise QuickdraftError(f"--resume: the checkpoint is at step {step}, past --steps {total}")
    end = min(total, stop_at) if stop_at is not None else total
    tokens_per_step = args["batch_size"] * args["grad_accum"] * args["seq_len"]
    tok_sha = _sha256(tok_json)
    say(f"{args['size']}: {n_params:,} parameters on {dev}{' (bf16 autocast)' if use_bf16 else ''}; corpus "
        f"{data.source}: {len(data.train)} + {len(data.heldout)} held-out files, {streams['train'].size:,} + "
        f"{streams['heldout'].size:,} tokens (tokenised in {tokenize_time:.1f}s); {tokens_per_step:,} tokens/step")

    def checkpoint(at: int) -> None:
        _save_checkpoint(ckpt_path, model, optimizer, at, args, config, log, tok_sha)

    # Ctrl-C finishes the current step and saves a checkpoint; a second Ctrl-C aborts at once.
    interrupted = threading.Event()

    def on_sigint(*_):
        if interrupted.is_set():
            raise KeyboardInterrupt
        interrupted.set()

    old_handler = None
    if threading.current_thread() is threading.main_thread():
        old_handler = signal.signal(signal.SIGINT, on_sigint)
    try:
        step = _loop(model, optimizer, sampler, heldout, args, log, dev, use_bf16, step, end, total,
                     eval_every, save_every, checkpoint, interrupted, tokens_per_step, verbose)
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)
        log["wall_time_s"] += time.perf_counter() - t_start
    if interrupted.is_set():
        checkpoint(step)
        say(f"interrupted: checkpoint saved at step {step}; continue with --resume")
        raise KeyboardInterrupt
    finished = step == total
    if finished and (not log["heldout_loss"] or log["heldout_loss"][-1][0] != step):
        log["heldout_loss"].append([step, evaluate(model, heldout, args["batch_size"], dev, use_bf16)])
    checkpoint(step)
    summary = {
        "out_dir": str(out), "size": args["size"], "params": n_params, "step": step, "steps": total,
        "finished": finished, "tokens_seen": step * tokens_per_step,
        "train_loss": log["train_loss"][-1] if log["train_loss"] else None,
        "heldout_loss": log["heldout_loss"][-1][1] if log["heldout_loss"] else None,
        "tokens_per_second": step * tokens_per_step / log["train_time_s"] if log["train_time_s"] else None,
        "train_time_s": log["train_time_s"], "wall_time_s": log["wall_time_s"],
    }
    if finished:
        save_hf_folder(model, config, out, save_dtype)
        training_log = {
            **summary, "args": args, "command": command, "device": str(dev), "bf16_autocast": use_bf16,
            "save_dtype": save_dtype, "config": config, "corpus": {**data.summary(),
            "tokens_train": int(streams["train"].size), "tokens_heldout": int(streams["heldout"].size)},
            "tokenizer": {"vocab_size": qd_tok.vocab_size, "train_time_s": log["tokenizer_time_s"]},
            "train_loss_curve": _loss_curve(log["train_loss"]), "heldout_loss_curve": log["heldout_loss"],
            "versions": {"torch": torch.__version__, "python": platform.python_version()},
        }
        (out / "training_log.json").write_text(json.dumps(training_log, indent=2) + "\n")
        write_model_card(out)
    if summary["train_loss"] is not None:
        held = "-" if summary["heldout_loss"] is None else f"{summary['heldout_loss']:.4f}"
        say(f"step {step}/{total}: train loss {summary['train_loss']:.4f}, held-out loss {held}, "
            f"{summary['tokens_per_second']:,.0f} tokens/s, {summary['wall_time_s']:.0f}s; "
            + (f"model written to {out}" if finished else "continue with --resume"))
    return summary


def _loop(model, optimizer, sampler, heldout, args, log, dev, use_bf16, step, end, total, eval_every, save_every,
          checkpoint, interrupted, tokens_per_step, verbose) -> int:
    """Optimizer steps step+1 .. end; returns the last completed step."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    params = [p for p in model.parameters()]
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[speed]} tok/s"),
                        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                        console=Console(stderr=True), disable=not verbose)
    with progress:
        task = progress.add_task("train", total=total, completed=step, loss="-", speed="-")
        while step < end and not interrupted.is_set():
            t0 = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, args["lr"], args["warmup"], total)
            loss_sum = 0.0
            for micro in range(args["grad_accum"]):
                batch = sampler.batch(step * args["grad_accum"] + micro).to(dev)
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_bf16):
                    loss = lm_loss(model, batch) / args["grad_accum"]
                loss.backward()
                loss_sum += loss.item()
            torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            elapsed = time.perf_counter() - t0
            log["train_time_s"] += elapsed
            log["train_loss"].append(loss_sum)
            progress.update(task, completed=step, loss=f"{loss_sum:.3f}", speed=f"{tokens_per_step / elapsed:,.0f}")
            if step % eval_every == 0 or step == total:
                held = evaluate(model, heldout, args["batch_size"], dev, use_bf16)
                log["heldout_loss"].append([step, held])
                if verbose:
                    progress.console.print(f"step {step}/{total}  train loss {loss_sum:.4f}  held-out loss {held:.4f}  "
                                           f"lr {optimizer.param_groups[0]['lr']:.2e}  "
                                           f"{step * tokens_per_step / log['train_time_s']:,.0f} tok/s")
            if step % save_every == 0 and step < total:
                checkpoint(step)
    return step
