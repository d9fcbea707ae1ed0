"""Distil a small draft from a target: `quickdraft distill`.

The draft is trained to match the target's own next-token distributions (DistillSpec,
Zhou et al. 2023, arXiv 2310.08461), not the corpus' one-hot labels: acceptance depends on
how often draft and target agree, and a target's distribution carries far more of that than
the token that happened to follow. The loss is the forward KL(p_target || q_draft) per token,
on two kinds of text:
  - windows of the corpus' train split (held-out files stay unseen), and
  - continuations the target generated itself (greedy and sampled at temperature 1), the
    text a draft actually sees at inference time.
Acceptance against the target on held-out prompts is measured before and after.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..config import EngineConfig, ModelConfig, SpecConfig
from ..errors import QuickdraftError
from ..engine import Engine
from ..metrics import SpecStats
from ..model.loader import load_model, resolve_device
from ..model.tokenizer import Tokenizer, eos_token_ids
from ..model.transformer import Transformer
from ..proposers.draft_model import DraftModelProposer
from ..sampling import SamplingParams
from . import tokenizer as tok_mod
from .card import write_model_card
from .corpus import load_corpus
from .data import WindowSampler, cached_tokens, eval_windows, fingerprint
from .export import hf_config, save_hf_folder
from .pretrain import GRAD_CLIP, evaluate, init_weights, lr_at, make_optimizer
from .prompts import opening_prompts
from .sizes import LEARNING_RATES, SIZES


def measure_acceptance(target: Transformer, draft: Transformer, prompts: list[list[int]], k: int = 5,
                       max_tokens: int = 64, batch: int = 8) -> dict[str, float]:
    """Greedy acceptance of `draft` against `target` on `prompts` (token ids)."""
    engine = Engine(target, DraftModelProposer(draft), EngineConfig(SpecConfig("draft", k), max_num_seqs=batch))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    stats = SpecStats()
    for out in engine.generate([(p, params) for p in prompts]):
        stats.merge(out.stats)
    return {"acceptance_rate": stats.acceptance_rate, "mean_acceptance_length": stats.mean_acceptance_length, "k": k}


@torch.inference_mode()
def generate_pool(target: Transformer, prompts: list[list[int]], new_tokens: int, seed: int,
                  batch: int = 64) -> list[list[int]]:
    """prompt + target continuation for every prompt: half greedy, half sampled at T = 1."""
    engine = Engine(target, None, EngineConfig(SpecConfig("none"), max_num_seqs=batch))
    requests = [(p, SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, max_tokens=new_tokens, seed=seed + i,
                                   ignore_eos=True)) for i, p in enumerate(prompts)]
    return [p + out.token_ids for (p, _), out in zip(requests, engine.generate(requests))]


def kl_loss(student: Transformer, teacher: Transformer, batch: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(p_teacher || q_student) on the inputs batch[:, :-1]."""
    inputs = batch[:, :-1]
    with torch.no_grad():
        log_p = teacher(inputs).float().log_softmax(-1)
    log_q = student(inputs).float().log_softmax(-1)
    return F.kl_div(log_q.flatten(0, 1), log_p.flatten(0, 1), log_target=True, reduction="batchmean")


def distill(target_dir: str | Path, out_dir: str | Path, *, size: str = "draft-xs", steps: int = 600,
            corpus: str | Path | None = None, batch_size: int = 16, seq_len: int = 256, lr: float | None = None,
            seed: int = 0, device: str | None = None, generated_fraction: float = 0.5, pool_prompts: int = 256,
            pool_new_tokens: int = 192, eval_prompts: int = 32, k: int = 5, eval_every: int = 100,
            bf16: bool | None = None, save_dtype: str = "bfloat16", verbose: bool = True,
            command: str | None = None) -> dict[str, Any]:
    """Distil a draft of size `size` from the target in `target_dir` into `out_dir`; returns a
    summary. `bf16` None: bf16 autocast on CUDA only (pass True on CPUs with native bf16)."""
    t_start = time.perf_counter()
    say = print if verbose else (lambda *a, **kw: None)
    if size not in SIZES:
        raise QuickdraftError(f"unknown --size {size!r}: choose one of {', '.join(SIZES)}")
    if not 0 <= generated_fraction <= 1:
        raise QuickdraftError(f"generated_fraction must be in [0, 1], got {generated_fraction}")
    for name, value in (("steps", steps), ("batch_size", batch_size), ("seq_len", seq_len), ("k", k)):
        if value < 1:
            raise QuickdraftError(f"{name} must be a positive integer, got {value}")
    out = Path(out_dir).expanduser()
    if (out / "model.safetensors").exists():
        raise QuickdraftError(f"{out} already holds a model: choose a new --out")
    dev = resolve_device(device)
    use_bf16 = (dev.type == "cuda" and torch.cuda.is_bf16_supported()) if bf16 is None else bf16
    target = load_model(target_dir, dtype="float32", device=dev)
    tcfg = target.config
    target_dir = Path(target_dir).expanduser()
    data = load_corpus(corpus)
    if not data.heldout:
        raise QuickdraftError(f"the corpus {data.source} has a single usable file; at least 2 are needed")

    out.mkdir(parents=True, exist_ok=True)
    tok_mod.copy_tokenizer(target_dir, out)  # same tokenizer, so the vocabularies match
    tok = Tokenizer(out)
    eos = eos_token_ids(target_dir, tok)
    bos = tok.bos_token_id
    if bos is None or not eos:
        raise QuickdraftError(f"the target's tokenizer in {target_dir} names no bos / eos token")
    size_cfg = dict(SIZES[size])
    size_cfg["max_position_embeddings"] = tcfg.max_position_embeddings
    config = hf_config(size_cfg, tcfg.vocab_size, bos, eos[0], tok.token_to_id(tok_mod.PAD), save_dtype)
    student = Transformer(ModelConfig.from_hf(config))
    init_weights(student, config["initializer_range"], seed)
    student.to(dev)
    n_params = sum(p.numel() for p in student.parameters())
    n_target = sum(p.numel() for p in target.parameters())

    tok_json = out / "tokenizer.json"
    streams = {split: cached_tokens(out / "data" / f"{split}.npy", fingerprint(tok_json, docs), tok._tok,
                                    [t for _, t in docs], bos, eos[0])
               for split, docs in (("train", data.train), ("heldout", data.heldout))}
    corpus_sampler = WindowSampler(streams["train"], seq_len, batch_size, seed)
    heldout = eval_windows(streams["heldout"], seq_len, 64)
    prompts = [tok.encode(p) for p in opening_prompts(data.heldout, eval_prompts)]
    if not prompts:  # a corpus without Python functions: take held-out text windows instead
        prompts = [w[:32].tolist() for w in heldout[:eval_prompts]]

    student.eval()
    before = measure_acceptance(target, student, prompts, k)
    say(f"draft {size}: {n_params:,} parameters ({n_params / n_target:.1%} of the target's {n_target:,}); "
        f"acceptance before distillation: {before['acceptance_rate']:.3f} "
        f"(mean acceptance length {before['mean_acceptance_length']:.2f}, k={k}, greedy, {len(prompts)} held-out prompts)")

    gen_batch = round(batch_size * generated_fraction)
    pool_time = 0.0
    gen_sampler = None
    if gen_batch > 0:
        t0 = time.perf_counter()
        rng = np.random.default_rng(seed)
        stream = streams["train"]
        starts = rng.integers(0, stream.size - 64, size=pool_prompts)
        pool_seed_prompts = [[bos] + stream[s:s + int(rng.integers(16, 64))].astype(np.int64).tolist() for s in starts]
        pool = generate_pool(target, pool_seed_prompts, pool_new_tokens, seed)
        pool_stream = np.concatenate([np.asarray(s + [eos[0]], dtype=np.int64) for s in pool])
        gen_sampler = WindowSampler(pool_stream, seq_len, gen_batch, seed + 1)
        pool_time = time.perf_counter() - t0
        say(f"generated {len(pool)} target continuations ({pool_stream.size:,} tokens) in {pool_time:.0f}s")

    lr = lr or LEARNING_RATES.get(size, 1e-3)
    warmup = max(1, min(100, steps // 20))
    optimizer = make_optimizer(student, lr, dev)
    params = list(student.parameters())
    student.train()
    target.eval()
    log: dict[str, Any] = {"kl": [], "heldout_loss": []}
    t_train = time.perf_counter()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    progress = Progress(TextColumn("[bold]distill"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("KL {task.fields[kl]}"), TimeElapsedColumn(), TextColumn("ETA"),
                        TimeRemainingColumn(), console=Console(stderr=True), disable=not verbose)
    with progress:
        task = progress.add_task("distill", total=steps, kl="-")
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, lr, warmup, steps)
            parts = [corpus_sampler.batch(step)[: batch_size - gen_batch]]
            if gen_sampler is not None:
                parts.append(gen_sampler.batch(step))
            batch = torch.cat([p for p in parts if len(p)]).to(dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_bf16):
                loss = kl_loss(student, target, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            log["kl"].append(loss.item())
            progress.update(task, completed=step + 1, kl=f"{loss.item():.3f}")
            if (step + 1) % eval_every == 0 or step + 1 == steps:
                held = evaluate(student, heldout, batch_size, dev, False)
                log["heldout_loss"].append([step + 1, held])
                progress.console.print(f"step {step + 1}/{steps}  KL {loss.item():.4f}  draft held-out loss {held:.4f}")
    train_time = time.perf_counter() - t_train

    student.eval()
    after = measure_acceptance(target, student, prompts, k)
    target_held = evaluate(target, heldout, batch_size, dev, False)
    draft_held = log["heldout_loss"][-1][1]
    say(f"acceptance after distillation: {after['acceptance_rate']:.3f} (mean acceptance length "
        f"{after['mean_acceptance_length']:.2f}); held-out loss: draft {draft_held:.4f}, target {target_held:.4f}")
    save_hf_folder(student, config, out, save_dtype)
    summary = {
        "out_dir": str(out), "target_dir": str(target_dir), "size": size, "params": n_params,
        "target_params": n_target, "steps": steps, "tokens_seen": steps * batch_size * seq_len,
        "final_kl": log["kl"][-1], "heldout_loss": draft_held, "target_heldout_loss": target_held,
        "acceptance_before": before, "acceptance_after": after, "eval_prompts": len(prompts),
        "train_time_s": train_time, "pool_time_s": pool_time, "wall_time_s": time.perf_counter() - t_start,
    }
    log_out = {**summary, "command": command, "device": str(dev), "bf16_autocast": use_bf16, "config": config,
               "args": {"batch_size": batch_size, "seq_len": seq_len, "lr": lr, "seed": seed,
                        "generated_fraction": generated_fraction, "pool_prompts": pool_prompts,
                        "pool_new_tokens": pool_new_tokens, "k": k},
               "corpus": data.summary(), "kl_curve": log["kl"][:: max(1, len(log["kl"]) // 200)],
               "heldout_loss_curve": log["heldout_loss"],
               "versions": {"torch": torch.__version__, "python": platform.python_version()}}
    (out / "distill_log.json").write_text(json.dumps(log_out, indent=2) + "\n")
    write_model_card(out)
    return summary
