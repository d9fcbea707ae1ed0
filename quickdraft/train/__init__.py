"""Training: the corpus, a byte-level BPE tokenizer, pretraining a target, distilling a
draft. `train` and friends import torch lazily so the CLI starts fast."""

from __future__ import annotations

__all__ = ["train", "distill", "load_corpus", "SIZES"]


def __getattr__(name: str):
    if name == "train":
        from .pretrain import train
        return train
    if name == "distill":
        from .distill import distill
        return distill
    if name == "load_corpus":
        from .corpus import load_corpus
        return load_corpus
    if name == "SIZES":
        from .sizes import SIZES
        return SIZES
    raise AttributeError(f"module 'quickdraft.train' has no attribute {name!r}")
