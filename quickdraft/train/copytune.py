"""Fine-tune a model to copy from its context (input-grounded continuation).

Small models trained briefly on plain code barely copy: shown a file and the start of an
edited copy of it, they wander off instead of repeating it. Real LLMs copy, and that is the
case prompt lookup and suffix decoding exist for. This continues training an existing model
on a mix of ordinary corpus windows and "edited copy" sequences built from the TRAIN split
(an excerpt, a blank line, then the excerpt again with one identifier renamed), so the
bundled target behaves like a real model on input-grounded work. Held-out files are never
used, so benchmark prompts stay unseen.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from ..model.loader import load_model
from ..model.tokenizer import Tokenizer
from ..train.corpus import load_corpus
from .data import WindowSampler, cached_tokens, eval_windows, fingerprint
from .export import save_hf_folder
from .pretrain import GRAD_CLIP, evaluate, lm_loss, lr_at, make_optimizer


def edited_copy(excerpt: str, rng: np.random.Generator) -> str | None:
    """excerpt + blank line + the excerpt with one of its repeated identifiers renamed."""
    from ..bench.workloads import rename_candidates, rename

    names = rename_candidates(excerpt)
    if not names:
        return None
    old = names[int(rng.integers(0, min(3, len(names))))]
    return excerpt + "\n\n" + rename(excerpt, old)


def copy_sequences(docs, tok: Tokenizer, n: int, seq_len: int, seed: int) -> torch.Tensor:
    """(n, seq_len + 1) token windows, each an edited-copy sequence (padded by more text)."""
    rng = np.random.default_rng(seed)
    rows = []
    bos = tok.bos_token_id
    while len(rows) < n:
        _, text = docs[int(rng.integers(0, len(docs)))]
        if len(text) < 200:
            continue
        chars = int(rng.integers(150, 450))
        start = int(rng.integers(0, max(1, len(text) - chars)))
        start = text.rfind("\n", 0, start) + 1
        excerpt = text[start:start + chars]
        excerpt = excerpt[: excerpt.rfind("\n") + 1]
        seq = edited_copy(excerpt, rng) if excerpt.count("\n") >= 3 else None
        if seq is None:
            continue
        ids = [bos] + tok.encode(seq)
        if len(ids) < seq_len + 1:
            continue
        rows.append(ids[: seq_len + 1])
    return torch.tensor(rows, dtype=torch.long)


def copy_tune(model_dir: str | Path, out_dir: str | Path, *, steps: int = 300, copy_fraction: float = 0.5,
              lr: float = 3e-4, batch_size: int = 16, seq_len: int = 256, bf16: bool = True, seed: int = 0,
              save_dtype: str = "bfloat16", eval_every: int = 50, verbose: bool = True) -> dict:
    model_dir, out = Path(model_dir), Path(out_dir)
    dev = torch.device("cpu")
    model = load_model(model_dir, dtype=torch.float32, device=dev)
    model.requires_grad_(True)  # loaded for inference
    tok = Tokenizer.from_dir(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    data = load_corpus(None)
    out.mkdir(parents=True, exist_ok=True)
    streams = {split: cached_tokens(out / "data" / f"{split}.npy", fingerprint(model_dir / "tokenizer.json", docs),
                                    tok._tok, [t for _, t in docs], tok.bos_token_id, tok.eos_token_id)
               for split, docs in (("train", data.train), ("heldout", data.heldout))}
    n_copy = max(1, round(batch_size * copy_fraction))
    sampler = WindowSampler(streams["train"], seq_len, batch_size - n_copy, seed + 1)
    copies = copy_sequences(data.train, tok, n_copy * steps, seq_len, seed)
    heldout = eval_windows(streams["heldout"], seq_len, 64)
    held_copies = copy_sequences(data.heldout, tok, 64, seq_len, seed + 7)
    optimizer = make_optimizer(model, lr, dev)
    model.train()
    log = {"steps": steps, "copy_fraction": copy_fraction, "lr": lr, "batch_size": batch_size, "seq_len": seq_len,
           "heldout_loss_before": evaluate(model, heldout, batch_size, dev, bf16),
           "heldout_copy_loss_before": evaluate(model, held_copies, batch_size, dev, bf16), "train_loss": []}
    if verbose:
        print(f"before: held-out loss {log['heldout_loss_before']:.4f}, copy loss {log['heldout_copy_loss_before']:.4f}")
    t0 = time.perf_counter()
    params = list(model.parameters())
    for step in range(steps):
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step, lr, max(1, steps // 20), steps)
        batch = torch.cat([sampler.batch(step), copies[step * n_copy:(step + 1) * n_copy]])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = lm_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log["train_loss"].append(loss.item())
        if verbose and (step + 1) % 10 == 0:
            print(f"step {step + 1}/{steps} loss {loss.item():.4f} {time.perf_counter() - t0:.0f}s", flush=True)
        if (step + 1) % eval_every == 0 and step + 1 < steps:
            pair = (evaluate(model, heldout, batch_size, dev, bf16), evaluate(model, held_copies, batch_size, dev, bf16))
            log.setdefault("evals", []).append([step + 1, *pair])
            if verbose:
                print(f"step {step + 1}: held-out loss {pair[0]:.4f}, copy loss {pair[1]:.4f}", flush=True)
    log["train_time_s"] = time.perf_counter() - t0
    log["heldout_loss_after"] = evaluate(model, heldout, batch_size, dev, bf16)
    log["heldout_copy_loss_after"] = evaluate(model, held_copies, batch_size, dev, bf16)
    if verbose:
        print(f"after: held-out loss {log['heldout_loss_after']:.4f}, copy loss {log['heldout_copy_loss_after']:.4f}")
    model.eval()
    save_hf_folder(model, config, out, save_dtype)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (model_dir / name).exists():
            (out / name).write_bytes((model_dir / name).read_bytes())
    (out / "copytune_log.json").write_text(json.dumps(log, indent=2) + "\n")
    return log
