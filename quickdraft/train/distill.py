"""Distil a small draft from a target: `quickdraft distill`.

The draft is trained to match the target's own next-token distributions (DistillSpec,
Zhou et al. 2023, arXiv 2310.08461), not the corpus' one-hot labels: acceptance depends on
how often draft and target agree, and a target's distribution carries far more of that than
the token that happened to follow. The loss is the forward KL(p_target || q_draft) per token,
on two kinds of text:
  - windows of the corpus' train split (held-out files stay unseen), and
  - text the target generated itself, the text a draft actually sees at inference time:
    continuations of corpus openings for a plain target; for a chat target (one whose
    tokenizer has a chat template), its answers to the instructions in `instructions.py`,
    rendered through its chat template, greedy and sampled at temperature 1.
The target can be any model source (folder, .gguf, catalogue name, Hub id). With
`teacher_topk` the target's distributions are computed once, for a fixed set of windows
(top-k log-probabilities plus the mass of the rest), and the draft trains for several epochs
on them: the target's forward is the expensive part, so this buys many more draft steps
per unit of compute than computing the target on every step. Acceptance against the target
on held-out prompts (held-out instructions for a chat target) is measured before and after.
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
from ..model.loader import checkpoint_dir, load_model, resolve_device
from ..model.sources import resolve_model
from ..model.tokenizer import Tokenizer, eos_token_ids
from ..model.transformer import Transformer
from ..proposers.draft_model import DraftModelProposer
from ..sampling import SamplingParams
from . import tokenizer as tok_mod
from .card import write_model_card
from .corpus import load_corpus
from .data import WindowSampler, cached_tokens, eval_windows, fingerprint
from .export import hf_config, save_hf_folder
from .instructions import HELDOUT, INSTRUCTIONS
from .pretrain import GRAD_CLIP, evaluate, init_weights, lr_at, make_optimizer
from .prompts import opening_prompts
from .sizes import LEARNING_RATES, SIZES

INITS = ("normal", "target-embedding")


def measure_acceptance(target: Transformer, draft: Transformer, prompts: list[list[int]], k: int = 5,
                       max_tokens: int = 64, batch: int = 8, temperature: float = 0.0,
                       eos: tuple[int, ...] = (), seed: int = 0) -> dict[str, float]:
    """Acceptance of `draft` against `target` on `prompts` (token ids); with `eos`, answers
    end there (chat prompts), else every prompt gets `max_tokens` new tokens."""
    engine = Engine(target, DraftModelProposer(draft), EngineConfig(SpecConfig("draft", k, policy="fixed"), max_num_seqs=batch),
                    eos_token_ids=eos)
    stats = SpecStats()
    requests = [(p, SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=not eos, seed=seed + i))
                for i, p in enumerate(prompts)]
    for out in engine.generate(requests):
        stats.merge(out.stats)
    return {"acceptance_rate": stats.acceptance_rate, "mean_acceptance_length": stats.mean_acceptance_length, "k": k,
            "temperature": temperature}


@torch.inference_mode()
def generate_pool(target: Transformer, prompts: list[list[int]], new_tokens: int, seed: int,
                  batch: int = 64, eos: tuple[int, ...] = (), greedy: list[bool] | None = None,
                  progress=None) -> list[list[int]]:
    """prompt + target continuation for every prompt: greedy where `greedy` says so (default:
    even indices), else sampled at T = 1. With `eos` a continuation ends at the target's eos
    (kept), else it runs `new_tokens`. `progress(finished, new_tokens_so_far)` is called as
    sequences finish."""
    greedy = [i % 2 == 0 for i in range(len(prompts))] if greedy is None else greedy
    engine = Engine(target, None, EngineConfig(SpecConfig("none"), max_num_seqs=batch), eos_token_ids=eos)
    requests = [(p, SamplingParams(temperature=0.0 if g else 1.0, max_tokens=new_tokens, seed=seed + i,
                                   ignore_eos=not eos)) for i, (p, g) in enumerate(zip(prompts, greedy))]
    if progress is None:
        return [p + out.token_ids for (p, _), out in zip(requests, engine.generate(requests))]
    ids = [engine.add_request(p, params) for p, params in requests]
    final: dict[str, list[int]] = {}
    tokens = 0
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out.token_ids
                    tokens += len(out.token_ids)
                    progress(len(final), tokens)
    except BaseException:
        for rid in ids:
            engine.abort_request(rid)
        raise
    return [p + final[rid] for (p, _), rid in zip(requests, ids)]


def kl_loss(student: Transformer, teacher: Transformer, batch: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(p_teacher || q_student) on the inputs batch[:, :-1]."""
    inputs = batch[:, :-1]
    with torch.no_grad():
        log_p = teacher(inputs).float().log_softmax(-1)
    log_q = student(inputs).float().log_softmax(-1)
    return F.kl_div(log_q.flatten(0, 1), log_p.flatten(0, 1), log_target=True, reduction="batchmean")


@torch.inference_mode()
def target_topk(teacher: Transformer, inputs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's k most likely next tokens at every position of inputs (B, T): their
    log-probabilities (B, T, k) float16 and ids (B, T, k) int32."""
    logits = teacher(inputs)  # (B, T, V)
    top, ids = logits.topk(k, dim=-1)
    log_p = top.float() - logits.float().logsumexp(-1, keepdim=True)
    return log_p.half(), ids.int()


def topk_kl_loss(student_logits: torch.Tensor, log_p: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of the KL between teacher and student over k + 1 outcomes: the
    teacher's top-k tokens one by one and "any other token" (its remaining mass), which
    is exact for the top-k and lumps the tail. logits (B, T, V); log_p, ids (B, T, k)."""
    log_q_all = student_logits.float().log_softmax(-1)
    log_q = log_q_all.gather(-1, ids.long())  # (B, T, k)
    p = log_p.float().exp()
    p_rest = (1 - p.sum(-1)).clamp_min(1e-8)
    q_rest = (1 - log_q.exp().sum(-1)).clamp_min(1e-8)
    kl = (p * (log_p.float() - log_q)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())
    return kl.mean()


def project_embedding(target: Transformer, hidden: int) -> torch.Tensor:
    """The target's input embedding (V, D) projected on its `hidden` leading right singular
    vectors (V, hidden): the best rank-`hidden` summary of how the target places tokens, a
    warm start for a draft of smaller width."""
    emb = target.model.embed_tokens.weight.detach().float().cpu()
    if hidden > emb.shape[1]:
        raise QuickdraftError(f"the draft's hidden size {hidden} exceeds the target's {emb.shape[1]}")
    _, _, vh = torch.linalg.svd(emb, full_matrices=False)
    return emb @ vh[:hidden].T


def _tile(stream: np.ndarray, seq_len: int, count: int, rng: np.random.Generator) -> torch.Tensor:
    """`count` windows of seq_len + 1 tokens: non-overlapping tiles of the stream in random
    order, again from a random offset once they are all used (count, seq_len + 1)."""
    length = seq_len + 1
    if stream.size < length:
        raise QuickdraftError(f"a token stream of {stream.size} tokens is shorter than one window ({length})")
    out: list[np.ndarray] = []
    while len(out) < count:
        offset = int(rng.integers(0, length)) if out else 0
        n = (stream.size - offset) // length
        tiles = stream[offset:offset + n * length].reshape(n, length)
        out.extend(tiles[rng.permutation(n)])
    return torch.from_numpy(np.stack(out[:count]).astype(np.int64))


def distill(target: str | Path, out_dir: str | Path, *, size: str = "draft-xs", steps: int = 600,
            corpus: str | Path | None = None, batch_size: int = 16, seq_len: int = 256, lr: float | None = None,
            seed: int = 0, device: str | None = None, generated_fraction: float = 0.5, pool_prompts: int = 256,
            pool_new_tokens: int = 192, eval_prompts: int = 32, k: int = 5, eval_every: int = 100,
            bf16: bool | None = None, save_dtype: str = "bfloat16", verbose: bool = True,
            command: str | None = None, teacher_dtype: str = "float32", teacher_topk: int = 0,
            teacher_windows: int = 0, init: str = "normal", instructions: bool | None = None,
            save_every: int = 0) -> dict[str, Any]:
    """Distil a draft of size `size` from `target` (a folder, .gguf, catalogue name or Hub id)
    into `out_dir`; returns a summary. `bf16` None: bf16 autocast on CUDA only (pass True on
    CPUs with native bf16). teacher_topk > 0: precompute the target's top-k distributions on
    `teacher_windows` windows (default steps * batch_size: one pass) and train on them.
    init "target-embedding": the draft's embedding starts as the target's, projected (SVD).
    instructions None: train on chat answers when the target has a chat template.
    save_every: write the draft folder every N steps, so a stopped run leaves a usable draft."""
    t_start = time.perf_counter()
    say = print if verbose else (lambda *a, **kw: None)
    if size not in SIZES:
        raise QuickdraftError(f"unknown --size {size!r}: choose one of {', '.join(SIZES)}")
    if init not in INITS:
        raise QuickdraftError(f"unknown --init {init!r}: choose one of {', '.join(INITS)}")
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
    target_path = resolve_model(target)
    target_dir = checkpoint_dir(target_path)  # config and tokenizer (a GGUF's metadata folder)
    teacher = load_model(target_path, dtype=teacher_dtype, device=dev)
    tcfg = teacher.config
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
    chat = bool(tok.chat_template) if instructions is None else instructions
    if chat and not tok.chat_template:
        raise QuickdraftError("--instructions needs a target with a chat template (tokenizer_config.json)")
    size_cfg = dict(SIZES[size])
    size_cfg["max_position_embeddings"] = tcfg.max_position_embeddings
    pad = tok.token_to_id(tok_mod.PAD)
    config = hf_config(size_cfg, tcfg.vocab_size, bos, eos[0], pad, save_dtype)
    student = Transformer(ModelConfig.from_hf(config))
    init_weights(student, config["initializer_range"], seed)
    if init == "target-embedding":
        with torch.no_grad():
            student.model.embed_tokens.weight.copy_(project_embedding(teacher, config["hidden_size"]))
    student.to(dev)
    n_params = sum(p.numel() for p in student.parameters())
    n_target = sum(p.numel() for p in teacher.parameters())

    tok_json = out / "tokenizer.json"
    streams = {split: cached_tokens(out / "data" / f"{split}.npy", fingerprint(tok_json, docs), tok._tok,
                                    [t for _, t in docs], bos, eos[0])
               for split, docs in (("train", data.train), ("heldout", data.heldout))}
    heldout = eval_windows(streams["heldout"], seq_len, 64)
    if chat:
        prompts = [tok.encode_chat([{"role": "user", "content": m}]) for m in HELDOUT[:eval_prompts]]
    else:
        prompts = [tok.encode(p) for p in opening_prompts(data.heldout, eval_prompts)]
        if not prompts:  # a corpus without Python functions: take held-out text windows instead
            prompts = [w[:32].tolist() for w in heldout[:eval_prompts]]
    eval_eos = eos if chat else ()
    eval_tokens = 128 if chat else 64

    student.eval()
    before = measure_acceptance(teacher, student, prompts, k, max_tokens=eval_tokens, eos=eval_eos)
    say(f"draft {size}: {n_params:,} parameters ({n_params / n_target:.1%} of the target's {n_target:,}); "
        f"acceptance before distillation: {before['acceptance_rate']:.3f} "
        f"(mean acceptance length {before['mean_acceptance_length']:.2f}, k={k}, greedy, {len(prompts)} held-out prompts)")

    gen_batch = round(batch_size * generated_fraction)
    pool_time, pool_tokens = 0.0, 0
    pool_stream = None
    if gen_batch > 0:
        t0 = time.perf_counter()
        rng = np.random.default_rng(seed)
        stream = streams["train"]
        greedy = None
        if chat:  # every instruction in turn: the greedy answer first, sampled ones after
            seeds = [tok.encode_chat([{"role": "user", "content": INSTRUCTIONS[i % len(INSTRUCTIONS)]}])
                     for i in range(pool_prompts)]
            greedy = [i < len(INSTRUCTIONS) for i in range(pool_prompts)]
        else:
            starts = rng.integers(0, stream.size - 64, size=pool_prompts)
            seeds = [[bos] + stream[s:s + int(rng.integers(16, 64))].astype(np.int64).tolist() for s in starts]
        pool = generate_pool(teacher, seeds, pool_new_tokens, seed, eos=eos if chat else (), greedy=greedy)
        pool_stream = np.concatenate([np.asarray(s if s[-1] in eos else s + [eos[0]], dtype=np.int64) for s in pool])
        pool_time, pool_tokens = time.perf_counter() - t0, int(pool_stream.size)
        say(f"generated {len(pool)} target {'answers' if chat else 'continuations'} ({pool_tokens:,} tokens) "
            f"in {pool_time:.0f}s")

    teacher_time = 0.0
    if teacher_topk > 0:  # one fixed token set, the target's top-k on it computed once
        t0 = time.perf_counter()
        total = teacher_windows or steps * batch_size
        rng = np.random.default_rng(seed + 2)
        n_gen = round(total * generated_fraction) if pool_stream is not None else 0
        windows = torch.cat([_tile(streams["train"], seq_len, total - n_gen, rng)]
                            + ([_tile(pool_stream, seq_len, n_gen, rng)] if n_gen else []))
        windows = windows[torch.from_numpy(rng.permutation(total))]
        log_ps, idss = [], []
        for chunk in windows.split(batch_size):
            log_p, ids = target_topk(teacher, chunk[:, :-1].to(dev), teacher_topk)
            log_ps.append(log_p.cpu())
            idss.append(ids.cpu())
        fixed = (windows, torch.cat(log_ps), torch.cat(idss))
        teacher_time = time.perf_counter() - t0
        say(f"target top-{teacher_topk} on {total} windows ({total * seq_len:,} tokens) in {teacher_time:.0f}s")
    else:
        corpus_sampler = WindowSampler(streams["train"], seq_len, batch_size, seed)
        gen_sampler = WindowSampler(pool_stream, seq_len, gen_batch, seed + 1) if pool_stream is not None else None

    def batch_at(step: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        if teacher_topk > 0:
            n = fixed[0].shape[0]
            epoch, i = divmod(step * batch_size, n)
            order = torch.from_numpy(np.random.default_rng([seed, epoch]).permutation(n))
            rows = order[(i + torch.arange(batch_size)) % n]
            return fixed[0][rows].to(dev), (fixed[1][rows].to(dev), fixed[2][rows].to(dev))
        parts = [corpus_sampler.batch(step)[: batch_size - gen_batch]]
        if gen_sampler is not None:
            parts.append(gen_sampler.batch(step))
        return torch.cat([p for p in parts if len(p)]).to(dev), None

    lr = lr or LEARNING_RATES.get(size, 1e-3)
    warmup = max(1, min(100, steps // 20))
    optimizer = make_optimizer(student, lr, dev)
    params = list(student.parameters())
    student.train()
    teacher.eval()
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
            batch, top = batch_at(step)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_bf16):
                if top is None:
                    loss = kl_loss(student, teacher, batch)
                else:
                    loss = topk_kl_loss(student(batch[:, :-1]), *top)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            log["kl"].append(loss.item())
            progress.update(task, completed=step + 1, kl=f"{loss.item():.3f}")
            if (step + 1) % eval_every == 0 or step + 1 == steps:
                held = evaluate(student, heldout, batch_size, dev, False)
                log["heldout_loss"].append([step + 1, held])
                progress.console.print(f"step {step + 1}/{steps}  KL {loss.item():.4f}  draft held-out loss {held:.4f}"
                                       f"  {time.perf_counter() - t_train:.0f}s")
            if save_every and (step + 1) % save_every == 0 and step + 1 < steps:
                save_hf_folder(student, config, out, save_dtype)  # a usable draft if the run stops here
    train_time = time.perf_counter() - t_train

    student.eval()
    after = measure_acceptance(teacher, student, prompts, k, max_tokens=eval_tokens, eos=eval_eos)
    target_held = evaluate(teacher, heldout, batch_size, dev, False)
    draft_held = log["heldout_loss"][-1][1]
    say(f"acceptance after distillation: {after['acceptance_rate']:.3f} (mean acceptance length "
        f"{after['mean_acceptance_length']:.2f}); held-out loss: draft {draft_held:.4f}, target {target_held:.4f}")
    save_hf_folder(student, config, out, save_dtype)
    summary = {
        "out_dir": str(out), "target_dir": str(target_dir), "target": str(target), "size": size, "params": n_params,
        "target_params": n_target, "steps": steps, "tokens_seen": steps * batch_size * seq_len,
        "final_kl": log["kl"][-1], "heldout_loss": draft_held, "target_heldout_loss": target_held,
        "acceptance_before": before, "acceptance_after": after, "eval_prompts": len(prompts),
        "eval_kind": "held-out instructions" if chat else "held-out openings", "eval_new_tokens": eval_tokens,
        "train_time_s": train_time, "pool_time_s": pool_time, "teacher_time_s": teacher_time,
        "wall_time_s": time.perf_counter() - t_start,
    }
    log_out = {**summary, "command": command, "device": str(dev), "threads": torch.get_num_threads(),
               "cpu": platform.processor() or platform.machine(), "bf16_autocast": use_bf16, "config": config,
               "args": {"batch_size": batch_size, "seq_len": seq_len, "lr": lr, "seed": seed,
                        "generated_fraction": generated_fraction, "pool_prompts": pool_prompts,
                        "pool_new_tokens": pool_new_tokens, "k": k, "teacher_dtype": teacher_dtype,
                        "teacher_topk": teacher_topk, "teacher_windows": fixed[0].shape[0] if teacher_topk else 0,
                        "init": init, "instructions": chat},
               "data": {"pool_texts": pool_prompts if gen_batch else 0, "pool_tokens": pool_tokens,
                        "instructions": min(pool_prompts, len(INSTRUCTIONS)) if chat and gen_batch else 0,
                        "heldout_instructions": len(prompts) if chat else 0},
               "corpus": data.summary(), "kl_curve": log["kl"][:: max(1, len(log["kl"]) // 200)],
               "heldout_loss_curve": log["heldout_loss"],
               "versions": {"torch": torch.__version__, "python": platform.python_version()}}
    (out / "distill_log.json").write_text(json.dumps(log_out, indent=2) + "\n")
    write_model_card(out)
    return summary
