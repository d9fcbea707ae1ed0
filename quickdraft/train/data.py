"""Token streams cached on disk, and the windows the trainer reads from them.

Each split is one long stream: for every file, bos + tokens + eos. It is cached as a
`.npy` next to a fingerprint of the tokenizer and the texts, so a resumed or repeated run
does not tokenise again, and a changed corpus or tokenizer is never read stale.

Batches are random contiguous windows of seq_len + 1 tokens (inputs and shifted targets).
A batch is a pure function of (seed, index), so resuming at step s reads exactly the
batches an uninterrupted run would have read; no sampler state is saved.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from ..errors import QuickdraftError
from .corpus import Document


def fingerprint(tokenizer_json: Path, docs: list[Document]) -> str:
    h = hashlib.sha256(tokenizer_json.read_bytes())
    for rel, text in docs:
        h.update(rel.encode() + b"\x00" + text.encode() + b"\x00")
    return h.hexdigest()


def tokenize(tokenizer, texts: list[str], bos_id: int, eos_id: int) -> np.ndarray:
    """One stream of bos + ids + eos per text; uint16 when the vocabulary fits."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = np.uint16 if size <= np.iinfo(np.uint16).max + 1 else np.int32
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    parts = [np.asarray([bos_id, *e.ids, eos_id], dtype=dtype) for e in encodings]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def cached_tokens(path: Path, key: str, tokenizer, texts: list[str], bos_id: int, eos_id: int) -> np.ndarray:
    """The stream at `path` if its fingerprint matches `key`, else tokenise and save it."""
    meta_path = path.with_suffix(".json")
    if path.exists() and meta_path.exists():
        try:
            if json.loads(meta_path.read_text()).get("fingerprint") == key:
                return np.load(path)
        except (OSError, ValueError):
            pass  # unreadable cache: rebuild it
    tokens = tokenize(tokenizer, texts, bos_id, eos_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.npy")
    np.save(tmp, tokens)
    os.replace(tmp, path)
    meta_path.write_text(json.dumps({"fingerprint": key, "tokens": int(tokens.size), "files": len(texts)}) + "\n")
    return tokens


class WindowSampler:
    """Random windows of `seq_len + 1` tokens from one stream; batch(i) depends only on
    (seed, i)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int):
        if tokens.size < seq_len + 1:
            raise QuickdraftError(
                f"the training split has {tokens.size} tokens, fewer than one window of seq_len + 1 = "
                f"{seq_len + 1}: use a larger corpus or a smaller --seq-len")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed

    def batch(self, index: int) -> torch.Tensor:
        """(batch_size, seq_len + 1) int64 token ids."""
        rng = np.random.default_rng([self.seed, index])
        starts = rng.integers(0, self.tokens.numel() - self.seq_len, size=self.batch_size)
        offsets = torch.arange(self.seq_len + 1)
        return self.tokens[torch.from_numpy(starts)[:, None] + offsets]  # (B, T + 1)


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> torch.Tensor:
    """A fixed set of evenly spaced windows (n, L) over the held-out stream, L = seq_len + 1
    or the whole stream when it is shorter; the same windows at every evaluation."""
    if tokens.size < 2:
        raise QuickdraftError("the held-out split has fewer than 2 tokens: use a larger corpus")
    length = min(seq_len + 1, int(tokens.size))
    count = max(1, min(max_windows, (int(tokens.size) - length) // length + 1))
    starts = np.linspace(0, tokens.size - length, count).astype(np.int64)
    stream = torch.from_numpy(tokens.astype(np.int64))
    return stream[torch.from_numpy(starts)[:, None] + torch.arange(length)]
