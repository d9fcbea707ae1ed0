"""Train a byte-level BPE tokenizer (GPT-2 style) and save it the Hugging Face way.

Byte-level means every string round-trips: characters never seen in training fall back
to their UTF-8 bytes, so decode(encode(x)) == x for any text, code with unicode included.
Special tokens have fixed ids: <|bos|> 0, <|eos|> 1, <|pad|> 2.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

from ..errors import QuickdraftError

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)  # ids 0, 1, 2
MIN_VOCAB = 256 + len(SPECIAL_TOKENS) + 1  # the byte alphabet, the specials, at least one merge
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def train_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 8192,
                    model_max_length: int = 1024):
    """Train on `texts` (the train split only: held-out text must stay unseen), write
    tokenizer.json and tokenizer_config.json into out_dir, return the `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < MIN_VOCAB:
        raise QuickdraftError(f"vocab_size must be at least {MIN_VOCAB}, got {vocab_size}")
    texts = list(texts)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i, (token, tok.token_to_id(token))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    write_tokenizer_config(out_dir, model_max_length)
    return tok


def write_tokenizer_config(out_dir: Path, model_max_length: int) -> None:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": model_max_length,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,  # code: keep " ," and " ." as written
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def copy_tokenizer(src: str | Path, out_dir: Path) -> None:
    """Reuse an existing tokenizer (a draft must share its target's)."""
    src = Path(src).expanduser()
    if not (src / "tokenizer.json").is_file():
        raise QuickdraftError(f"--tokenizer: no tokenizer.json in {src}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and (src / name).resolve() != (out_dir / name).resolve():
            shutil.copyfile(src / name, out_dir / name)
