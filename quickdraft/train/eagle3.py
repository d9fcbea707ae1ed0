"""Train an EAGLE-3 head for a target, with EAGLE-3's training-time test (arXiv 2503.01840).

The head learns the target's own next-token distributions (soft labels over the draft
vocabulary, renormalised there) from the target's hidden states at its three layers, on
token sequences the caller provides (text the target generated itself is what the head
meets at inference: `train_eagle3` trains on the target's continuations of corpus openings).

Training-time test: step 0 feeds the pairs (target state at p, token at p + 1) and predicts
the target's distribution at p + 1; step j > 0 feeds the head's own output of step j - 1 at
p with the token at p + 1 + j, one position on, and predicts the target at p + 1 + j. A
step-j query at p attends to the step-0 keys at positions <= p and to the keys of steps
1..j at p: exactly the keys a chain's j-th draft token reads at inference (the context's
pairs and the draft's own earlier steps). The losses of all steps are summed, step j
weighted by `decay ** j`.

The target's hidden states and final states are computed once per sequence batch (no
gradient); the target's embedding is shared and frozen.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from ..model.eagle3 import Eagle3Head
from ..model.transformer import attention_inputs, rotate


def _attend(attn, x, cos, sin, past: list[tuple[torch.Tensor, torch.Tensor]], mask):
    """The head's attention over its own new keys plus earlier steps' keys (no cache writes,
    so autograd sees every step)."""
    B, T, _ = x.shape
    H, H_kv, D = attn.n_heads, attn.n_kv, attn.head_dim
    q = rotate(attn.q_proj(x).view(B, T, H, D), cos, sin).transpose(1, 2)
    k = rotate(attn.k_proj(x).view(B, T, H_kv, D), cos, sin).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, H_kv, D).transpose(1, 2)
    keys = torch.cat([pk for pk, _ in past] + [k], dim=2)
    values = torch.cat([pv for _, pv in past] + [v], dim=2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=H_kv != H)
    return attn.o_proj(out.transpose(1, 2).reshape(B, T, H * D)), (k, v)


def _ttt_mask(T: int, step: int, device) -> torch.Tensor:
    """(T, (step + 1) T): step-0 keys causally, then each later step's key at the same index."""
    p = torch.arange(T, device=device)
    parts = [p[None, :] <= p[:, None]] + [torch.eye(T, dtype=torch.bool, device=device)] * step
    return torch.cat(parts, dim=1)


@torch.no_grad()
def target_features(head: Eagle3Head, target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What training reads from the target for sequences ids (B, T): the head's input states
    (B, T, 3h) and the target's final normed states (B, T, h), both float32."""
    L = target.config.num_hidden_layers
    _, hidden = target.forward_hidden(ids, hidden_at=(*head.aux_layers, L), logits_at=ids.new_zeros(ids.shape[0], 1))
    h = target.config.hidden_size
    return hidden[..., :-h].float(), target.model.norm(hidden[..., -h:]).float()


def cache_features(head: Eagle3Head, target, windows: Sequence[list[int]], batch: int = 16,
                   log=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`target_features` of every window (computed once, in batches of equal-length windows)."""
    out: list = [None] * len(windows)
    order = sorted(range(len(windows)), key=lambda i: len(windows[i]))
    groups: list[list[int]] = []
    for i in order:
        if groups and len(windows[groups[-1][0]]) == len(windows[i]) and len(groups[-1]) < batch:
            groups[-1].append(i)
        else:
            groups.append([i])
    start, done = time.perf_counter(), 0
    for n, group in enumerate(groups):
        ids = torch.tensor([windows[i] for i in group], device=head.device)
        feats, final = target_features(head, target, ids)
        for row, i in enumerate(group):
            out[i] = (feats[row].clone(), final[row].clone())
        done += ids.numel()
        if log is not None and (n + 1) % 100 == 0:
            log({"target_features": f"{n + 1}/{len(groups)} batches",
                 "tokens_per_s": round(done / (time.perf_counter() - start), 1)})
    return out


def ttt_loss(head: Eagle3Head, target, ids: torch.Tensor, steps: int = 3, decay: float = 0.8,
             features: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Loss and per-step top-1 agreement with the target on sequences ids (B, T); `features`:
    `target_features(head, target, ids)` when the caller has them already."""
    B, T = ids.shape
    with torch.no_grad(), torch.autocast(ids.device.type, enabled=False):  # the target in its own precision
        feats, final = target_features(head, target, ids) if features is None else features
        # the target's distribution renormalised on the draft vocabulary: its logits there only
        w = target.lm_head.weight[head.draft_to_target].float()
        p_target = F.linear(final, w).softmax(-1)  # (B, T, draft V)
        embeds = head.embed_tokens(ids).float()
    layer = head.midlayer
    hidden = head.fc(feats.float())  # (B, T, h): step 0's hidden input at p
    past: list[tuple[torch.Tensor, torch.Tensor]] = []
    total = ids.new_zeros((), dtype=torch.float32)
    agree = []
    for j in range(steps):
        n = T - 1 - j  # queries p = 0 .. n - 1 have a token at p + 1 + j and a target at p + 1 + j
        if n <= 0:
            break
        positions = (torch.arange(T, device=ids.device) + j).expand(B, T)
        cos, sin, *_ = attention_inputs(head.inv_freq, torch.float32, positions, None, None, None, None)
        emb = torch.cat([embeds[:, 1 + j:], embeds.new_zeros(B, 1 + j, embeds.shape[-1])], 1)  # token p + 1 + j
        normed = layer.hidden_norm(hidden)
        residual = normed if layer.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(emb), normed], dim=-1)
        a, kv = _attend(layer.self_attn, x, cos, sin, past, _ttt_mask(T, j, ids.device))
        past.append(kv)
        x = residual + a
        out = x + layer.mlp(layer.post_attention_layernorm(x))
        logq = head.lm_head(head.norm(out)).float().log_softmax(-1)  # (B, T, draft V)
        want = p_target[:, 1 + j:]
        step_loss = -(want * logq[:, :n]).sum(-1).mean()
        total = total + decay ** j * step_loss
        agree.append((logq[:, :n].argmax(-1) == want.argmax(-1)).float().mean().item())
        hidden = out
    return total, agree


def train_head(head: Eagle3Head, target, sequences: Sequence[list[int]], *, epochs: int = 1, batch_size: int = 8,
               seq_len: int = 128, lr: float = 3e-3, steps: int = 3, decay: float = 0.8, seed: int = 0,
               log=None, checkpoint: Path | None = None, cache_limit_bytes: int = 12 << 30,
               progress=None, bf16: bool | None = None) -> list[dict]:
    """Train `head` (in place, float32) on windows of `sequences`; returns the log per epoch.
    With `checkpoint`, the head, optimiser and schedule are saved there after every epoch and,
    when the file exists, training resumes after its last epoch. The target's states for every
    window are computed once and kept (float32, 16 h bytes per token) when that fits in
    `cache_limit_bytes` (0: recompute them for every batch, every epoch). `progress(done, total,
    loss, tokens_per_s)` is called after every optimiser step (done / total: steps of the run).
    `bf16`: the head's forward and backward under bfloat16 autocast (float32 weights, optimiser
    and loss; the target's states and distributions stay float32); default: where bfloat16
    matmuls are fast (CUDA, CPUs with AVX512-BF16 / AMX: 2.3x faster per step for SmolLM2's
    head here)."""
    g = torch.Generator().manual_seed(seed)
    windows = [s[i:i + seq_len] for s in sequences for i in range(0, max(len(s) - 1, 1), seq_len)
               if len(s[i:i + seq_len]) >= steps + 2]
    if not windows:
        raise ValueError("no training windows: sequences are too short")
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    total_steps = epochs * math.ceil(len(windows) / batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / max(1, total_steps // 20)) * 0.5 * (1 + math.cos(math.pi * i / total_steps)))
    history: list[dict] = []
    first = 0
    if checkpoint is not None and checkpoint.exists():
        saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
        head.load_state_dict(saved["head"])
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        g.set_state(saved["generator"])
        history, first = list(saved["history"]), int(saved["epoch"]) + 1
        if log is not None:
            log({"resumed_after_epoch": first - 1})
    device = head.device
    if bf16 is None:
        bf16 = _fast_bf16(device)
    features = None
    if cache_limit_bytes and sum(map(len, windows)) * 4 * 4 * target.config.hidden_size <= cache_limit_bytes:
        features = cache_features(head, target, windows, log=log)
    head.train()
    for epoch in range(first, epochs):
        order = torch.randperm(len(windows), generator=g).tolist()
        start, losses, agrees, seen = time.perf_counter(), [], [], 0
        for b in range(0, len(order), batch_size):
            chunk = [windows[i] for i in order[b:b + batch_size]]
            width = min(len(c) for c in chunk)  # equal lengths: no padding inside the loss
            ids = torch.tensor([c[:width] for c in chunk], device=device)
            feats = None if features is None else tuple(
                torch.stack([features[i][part][:width] for i in order[b:b + batch_size]]) for part in (0, 1))
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss, agree = ttt_loss(head, target, ids, steps, decay, feats)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            agrees.append(agree)
            seen += ids.numel()
            if progress is not None:
                progress(epoch * math.ceil(len(windows) / batch_size) + b // batch_size + 1, total_steps,
                         losses[-1], seen / (time.perf_counter() - start))
        seconds = time.perf_counter() - start
        entry = {"epoch": epoch, "loss": sum(losses) / len(losses),
                 "agreement_per_step": [round(sum(a[j] for a in agrees if len(a) > j) / len(agrees), 4)
                                        for j in range(steps)],
                 "seconds": round(seconds, 1), "windows": len(windows), "bf16_autocast": bf16,
                 "tokens_per_s": round(sum(len(w) for w in windows) / seconds, 1)}
        history.append(entry)
        if checkpoint is not None:
            tmp = checkpoint.with_suffix(".tmp")
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "generator": g.get_state(), "history": history, "epoch": epoch}, tmp)
            tmp.replace(checkpoint)
        if log is not None:
            log(entry)
    head.eval()
    return history


def _fast_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    from ..model.quant import onednn_bf16_supported

    return device.type == "cpu" and onednn_bf16_supported()


def measure_head(target, head, prompts: list[list[int]], k: int = 5, max_tokens: int = 64,
                 temperature: float = 0.0, seed: int = 0, eos: tuple[int, ...] = ()) -> dict[str, float]:
    """Acceptance of `head` against `target` on `prompts` (each gets `max_tokens` new tokens,
    or ends at `eos`)."""
    from ..config import EngineConfig, SpecConfig
    from ..engine import Engine
    from ..metrics import SpecStats
    from ..proposers.eagle3 import Eagle3Proposer
    from ..sampling import SamplingParams

    engine = Engine(target, Eagle3Proposer(head, target.config.vocab_size),
                    EngineConfig(SpecConfig("eagle3", k, policy="fixed"), max_num_seqs=8), eos_token_ids=eos)
    stats = SpecStats()
    requests = [(p, SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=not eos, seed=seed + i))
                for i, p in enumerate(prompts)]
    for out in engine.generate(requests):
        stats.merge(out.stats)
    n = stats.num_drafts
    return {"acceptance_rate": round(stats.acceptance_rate, 4),
            "mean_acceptance_length": round(stats.mean_acceptance_length, 3), "k": k, "temperature": temperature,
            "accepted_by_position": [round(a / n, 4) if n else 0.0 for a in stats.accepted_per_pos[:k]]}


def train_eagle3(target_path, out_dir, *, prompts: int = 256, new_tokens: int = 128, epochs: int = 4,
                 batch_size: int = 8, seq_len: int = 128, lr: float = 3e-3, ttt_steps: int = 3,
                 draft_vocab: int | None = None, chat: bool | None = None, eval_prompts: int = 16, seed: int = 0,
                 corpus_windows: int = 64, resume: bool = False, save_bf16: bool = True, log=print,
                 progress: bool = False, bf16: bool | None = None) -> dict:
    """Train and save an EAGLE-3 head for `target_path` on its own text: its answers to the
    instructions in `instructions.py` for a chat target (one with a chat template; `chat`
    overrides), else its continuations of corpus openings; greedy and sampled at T = 1 in
    turn; plus `corpus_windows` windows of the corpus' train split as they are (the target's
    distributions on them are the labels). Acceptance on held-out instructions / openings
    (rate, mean acceptance length, by position) is measured before and after. The generated
    text (`sequences.json`) and a checkpoint after every epoch (`checkpoint.pt`) are kept in
    `out_dir`; `resume` continues from them. The head is saved in bfloat16 (`save_bf16`),
    float32 otherwise; it loads in the target's dtype. `bf16`: autocast for the head's training
    (`train_head`). `progress`: rich progress bars (on
    stderr) for the generation (sequences, tokens) and the training (steps, loss, tokens/s)."""
    from ..errors import QuickdraftError
    from ..model.loader import checkpoint_dir, load_model
    from ..model.sources import resolve_model
    from ..model.tokenizer import Tokenizer, eos_token_ids
    from .corpus import load_corpus
    from .instructions import HELDOUT, chat_instructions
    from .prompts import opening_prompts

    torch.manual_seed(seed)
    folder = checkpoint_dir(resolve_model(target_path))
    target = load_model(folder, dtype="float32")
    tok = Tokenizer.from_dir(folder)
    chat = bool(tok.chat_template) if chat is None else chat
    if chat and not tok.chat_template:
        raise QuickdraftError("chat training needs a target with a chat template (tokenizer_config.json)")
    eos = tuple(eos_token_ids(folder, tok)) if chat else ()
    if chat:
        seeds = [tok.encode_chat([{"role": "user", "content": m}]) for m in chat_instructions(prompts, seed)]
        held = [tok.encode_chat([{"role": "user", "content": m}]) for m in HELDOUT[:eval_prompts]]
    else:
        corpus = load_corpus()
        seeds = [tok.encode(p) for p in opening_prompts(corpus.train, prompts)]
        held = [tok.encode(p) for p in opening_prompts(corpus.heldout, eval_prompts)]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _bars(progress) as bars:
        return _train_eagle3(target, target_path, tok, chat, eos, seeds, held, out, bars, log, new_tokens=new_tokens,
                             epochs=epochs, batch_size=batch_size, seq_len=seq_len, lr=lr, ttt_steps=ttt_steps,
                             draft_vocab=draft_vocab, seed=seed, corpus_windows=corpus_windows, resume=resume,
                             save_bf16=save_bf16, bf16=bf16)


class _Lines:
    """Progress as a line per task at most every `every` seconds (and at its end), for a stderr
    that is not a terminal (a log file), where a live bar would print nothing until the end."""

    def __init__(self, console, every: float = 60.0):
        self.console, self.every, self.tasks = console, every, []

    def add_task(self, name: str, total: int, info: str = "") -> int:
        self.tasks.append({"name": name, "total": total, "last": time.perf_counter(), "start": time.perf_counter()})
        return len(self.tasks) - 1

    def update(self, task: int, completed: int, info: str = "", total: int | None = None) -> None:
        t = self.tasks[task]
        if total is not None:
            t["total"] = total
        now = time.perf_counter()
        if now - t["last"] >= self.every or completed >= t["total"]:
            t["last"] = now
            self.console.print(f"{t['name']} {completed}/{t['total']} {info} ({now - t['start']:.0f} s)",
                               highlight=False)


@contextlib.contextmanager
def _bars(enabled: bool):
    """A rich Progress on stderr (None when not `enabled`; lines when stderr is no terminal)."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        yield _Lines(console)
        return
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                  console=console) as bars:
        yield bars


def _train_eagle3(target, target_path, tok, chat, eos, seeds, held, out: Path, bars, log, *, new_tokens, epochs,
                  batch_size, seq_len, lr, ttt_steps, draft_vocab, seed, corpus_windows, resume, save_bf16,
                  bf16) -> dict:
    import json

    from ..model.eagle3 import new_head, save_eagle3
    from .corpus import load_corpus
    from .distill import generate_pool

    def bar(name: str, total: int):
        """A progress callback for one phase: (done, info, total=None) -> None."""
        if bars is None:
            return None
        task = bars.add_task(name, total=total, info="")
        return lambda done, info, total=None: bars.update(task, completed=done, info=info, total=total)

    cached, timing = out / "sequences.json", out / "sequences_seconds.txt"
    start = time.perf_counter()
    gen_s = None
    if resume and cached.exists():
        sequences = json.loads(cached.read_text())
        log({"reused_sequences": len(sequences), "from": str(cached)})
        if timing.exists():  # the generation's own time, not the reload's
            gen_s = float(timing.read_text())
    else:
        greedy = [i % 2 == 0 for i in range(len(seeds))]
        gen_bar = bar("generate", len(seeds))
        sequences = generate_pool(target, seeds, new_tokens, seed, eos=eos, greedy=greedy,
                                  progress=None if gen_bar is None else lambda n, tokens: gen_bar(
                                      n, f"{tokens:,} tokens, {tokens / (time.perf_counter() - start):,.0f} tok/s"))
        if corpus_windows:
            corpus = load_corpus()
            text = [t for doc in corpus.train[: corpus_windows * 4] for t in tok.encode(doc[1])]
            sequences += [text[i:i + seq_len] for i in range(0, len(text) - seq_len, seq_len)][:corpus_windows]
        cached.write_text(json.dumps(sequences))
        gen_s = time.perf_counter() - start
        timing.write_text(f"{gen_s:.1f}")
        log({"sequences": len(sequences), "tokens": sum(map(len, sequences)), "seconds": round(gen_s, 1)})
    vocab = None
    if draft_vocab is not None and draft_vocab < target.config.vocab_size:  # the most frequent target tokens
        counts = torch.bincount(torch.tensor([t for s in sequences for t in s]), minlength=target.config.vocab_size)
        vocab = counts.topk(draft_vocab).indices
    head = new_head(target, vocab)
    measure = dict(max_tokens=128 if chat else 64, eos=eos)
    checkpoint = out / "checkpoint.pt"
    if not resume and checkpoint.exists():
        checkpoint.unlink()
    before = None if checkpoint.exists() else measure_head(target, head, held, **measure)
    train_bar = bar("train", 1)

    def step_done(done, total, loss, tokens_per_s):
        train_bar(done, f"loss {loss:.3f}, {tokens_per_s:,.0f} tok/s", total)

    history = train_head(head, target, sequences, epochs=epochs, batch_size=batch_size, seq_len=seq_len, lr=lr,
                         steps=ttt_steps, seed=seed, log=log, checkpoint=checkpoint,
                         progress=None if train_bar is None else step_done, bf16=bf16)
    after = measure_head(target, head, held, **measure)
    report = {"target": str(target_path), "kind": "chat answers" if chat else "code continuations",
              "sequences": len(sequences), "new_tokens": new_tokens, "generate_seconds": None if gen_s is None else round(gen_s, 1),
              "epochs": history, "acceptance_before": before, "acceptance_after": after,
              "eval": f"{len(held)} held-out {'instructions' if chat else 'openings'}",
              "draft_vocab_size": head.head_config.draft_vocab_size, "ttt_steps": ttt_steps, "lr": lr,
              "batch_size": batch_size, "seq_len": seq_len, "torch_threads": torch.get_num_threads()}
    save_eagle3(head, out, dtype=torch.bfloat16 if save_bf16 else None)
    (out / "train_log.json").write_text(json.dumps(report, indent=2))
    log({"acceptance_before": before, "acceptance_after": after})
    return report
