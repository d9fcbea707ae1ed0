"""quickdraft train: corpus split, tokenizer, data windows, pretraining, exact resume, and
the Hugging Face folder it writes (read back by quickdraft and by transformers)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open

from quickdraft import LLM, QuickdraftError, SamplingParams, load_model
from quickdraft.config import ModelConfig
from quickdraft.model.tokenizer import Tokenizer
from quickdraft.model.transformer import Transformer
from quickdraft.train.corpus import load_corpus, split, stdlib_files
from quickdraft.train.data import WindowSampler, cached_tokens, eval_windows
from quickdraft.train.pretrain import lr_at, train
from quickdraft.train.sizes import SIZES, count_params

SOURCES = {
    "arith.py": "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n",
    "point.py": "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
                "    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n",
    "loops.py": "for i in range(10):\n    if i % 2 == 0:\n        print(i * i)\n    else:\n        continue\n",
    "main.py": "import os\nimport sys\n\n\ndef main():\n    print(os.getcwd(), sys.argv)\n\n\n"
               "if __name__ == '__main__':\n    main()\n",
    "pkg/strings.py": "GREETING = 'Grüße, 世界 ✓'\n\n\ndef shout(text: str) -> str:\n    return text.upper() + '!'\n",
    "pkg/files.py": "def read(path):\n    with open(path, encoding='utf-8') as f:\n        return f.read()\n",
    "notes.md": "# Notes\n\nThe quick brown fox jumps over the lazy dog. Ünïcödé text, naïve café.\n",
    "maths.py": "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
}
ARGS = dict(size="tiny", steps=6, batch_size=4, seq_len=32, eval_every=3, save_every=2, seed=1,
            verbose=False)


def write_corpus(folder):
    for rel, text in SOURCES.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text * 3, encoding="utf-8")
    (folder / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")  # binary: skipped
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")  # hidden: skipped
    return folder


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_dir):
    out = tmp_path_factory.mktemp("trained") / "model"
    summary = train(out, corpus=corpus_dir, **ARGS)
    return out, summary


# -- corpus ------------------------------------------------------------------------------

def test_corpus_split_is_deterministic_and_disjoint(corpus_dir):
    a, b = load_corpus(corpus_dir), load_corpus(corpus_dir)
    assert a == b
    train_paths, held_paths = {p for p, _ in a.train}, {p for p, _ in a.heldout}
    assert not train_paths & held_paths
    assert train_paths | held_paths == set(SOURCES)  # binary and hidden files left out
    assert held_paths and a.skipped == 1
    assert [p for p, _ in a.train] == sorted(train_paths)


def test_split_rules():
    docs = [(f"f{i}.py", "x") for i in range(200)]
    train_docs, held = split(docs)
    assert len(held) >= 10 and train_docs and len(train_docs) + len(held) == 200
    assert split(docs) == (train_docs, held)
    assert split(docs[:40])[1][0] in docs[:40] and len(split(docs[:40])[1]) >= 2  # topped up to 5%
    t2, h2 = split(docs[:2])
    assert len(t2) == len(h2) == 1
    assert split(docs[:1]) == (docs[:1], [])


def test_stdlib_corpus():
    files = stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts or "dist-packages" in f.parts for f in files)
    corpus = load_corpus(None)
    n_train, n_held = len(corpus.train), len(corpus.heldout)
    assert 0.05 <= n_held / (n_train + n_held) <= 0.08, (n_train, n_held)
    assert not {p for p, _ in corpus.train} & {p for p, _ in corpus.heldout}


@pytest.mark.parametrize("case, needle", [("missing", "not found"), ("empty", "has no files"),
                                          ("binary", "no usable text files"), ("file", "must be a folder")])
def test_bad_corpus_is_a_clear_error(tmp_path, case, needle):
    folder = tmp_path / "corpus"
    if case == "empty":
        folder.mkdir()
    elif case == "binary":
        folder.mkdir()
        (folder / "a.bin").write_bytes(b"\x00\x01\x02\x03")
        (folder / "b.txt").write_bytes(b"caf\xe9 latin-1, not utf-8")
    elif case == "file":
        folder.write_text("hello")
    with pytest.raises(QuickdraftError, match=needle):
        load_corpus(folder)
    with pytest.raises(QuickdraftError, match=needle):
        train(tmp_path / "out", corpus=folder, **ARGS)
    assert not (tmp_path / "out").exists()  # nothing written before the corpus is checked


def test_cli_bad_corpus_exits_2_with_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "quickdraft.cli", "train", "--out", str(tmp_path / "out"),
                        "--corpus", str(tmp_path / "nope")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2
    assert "corpus folder not found" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


# -- sizes, schedule, data ---------------------------------------------------------------

def test_size_table_parameter_counts():
    for name, cfg in SIZES.items():
        with torch.device("meta"):
            model = Transformer(ModelConfig.from_hf(cfg))
        assert count_params(cfg) == sum(p.numel() for p in model.parameters()), name
    assert 1.5e6 <= count_params(SIZES["draft-xs"]) <= 3e6
    assert 25e6 <= count_params(SIZES["target-s"]) <= 30e6
    assert SIZES["draft-xs"]["vocab_size"] == SIZES["target-s"]["vocab_size"]
    # the smollm2 draft: 14,944,512 parameters, at most 1/8 of SmolLM2-135M's 134,515,008, its vocabulary
    assert count_params(SIZES["draft-smollm2"]) == 14_944_512 <= 134_515_008 / 8
    assert SIZES["draft-smollm2"]["vocab_size"] == 49152


def test_lr_schedule():
    peak, warmup, total = 1e-3, 10, 100
    assert lr_at(0, peak, warmup, total) == pytest.approx(1e-4)
    assert lr_at(9, peak, warmup, total) == pytest.approx(peak)
    assert lr_at(total, peak, warmup, total) == pytest.approx(0.1 * peak)
    lrs = [lr_at(s, peak, warmup, total) for s in range(warmup, total)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_window_sampler_is_a_function_of_seed_and_index():
    tokens = np.arange(1000, dtype=np.uint16)
    s = WindowSampler(tokens, seq_len=16, batch_size=4, seed=3)
    b = s.batch(7)
    assert b.shape == (4, 17) and b.dtype == torch.int64
    assert torch.equal(b, WindowSampler(tokens, 16, 4, seed=3).batch(7))
    assert not torch.equal(b, s.batch(8))
    assert torch.equal(b[:, 1:] - b[:, :-1], torch.ones(4, 16, dtype=torch.int64))  # contiguous
    with pytest.raises(QuickdraftError, match="seq-len"):
        WindowSampler(tokens[:10], seq_len=16, batch_size=4, seed=0)
    w = eval_windows(tokens[:50], seq_len=16, max_windows=8)
    assert w.shape == (2, 17) and eval_windows(tokens[:10], 16, 8).shape == (1, 10)


# -- training and the folder it writes ------------------------------------------------------

def test_output_folder(trained):
    out, summary = trained
    assert summary["finished"] and summary["step"] == 6 and summary["tokens_seen"] == 6 * 4 * 32
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "training_log.json", "checkpoint.pt", "data/train.npy"):
        assert (out / name).exists(), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] and cfg["torch_dtype"] == "bfloat16"
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (0, 1, 2)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    log = json.loads((out / "training_log.json").read_text())
    assert log["steps"] == 6 and log["params"] == count_params(SIZES["tiny"])
    assert [s for s, _ in log["heldout_loss_curve"]] == [3, 6]
    assert np.isfinite(log["heldout_loss"]) and log["train_loss_curve"][-1][0] == 6
    assert log["corpus"]["files_heldout"] >= 1 and log["tokenizer"]["vocab_size"] <= 512


def test_tokenizer_roundtrip(trained):
    tok = Tokenizer(trained[0])
    assert (tok.bos_token_id, tok.eos_token_id, tok.token_to_id("<|pad|>")) == (0, 1, 2)
    text = "def grüße(x: str) -> str:\n\treturn f'{x} 世界 ✓ 🐍'  # naïve\n\n    \r\n"
    ids = tok.encode(text)
    assert ids[0] == 0 and tok.decode(ids) == text


def test_loads_in_quickdraft_and_transformers_with_same_logits(trained):
    from transformers import AutoModelForCausalLM

    out = trained[0]
    ours = load_model(out, dtype=torch.float32, device="cpu")
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([Tokenizer(out).encode("def add(a, b):\n    return a + b\n")])
    with torch.no_grad():
        diff = (ours(ids) - theirs(ids).logits).abs().max().item()
    assert diff <= 1e-3


def test_llm_generates_text(trained):
    llm = LLM(target=trained[0], method="none", device="cpu")
    [result] = llm.generate("def add(a, b):", SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(result.token_ids) == 8 and isinstance(result.text, str)


def test_resume_matches_an_uninterrupted_run(trained, corpus_dir, tmp_path):
    out_a, summary_a = trained
    out_b = tmp_path / "b"
    first = train(out_b, corpus=corpus_dir, stop_at=3, **ARGS)
    assert not first["finished"] and first["step"] == 3 and not (out_b / "model.safetensors").exists()
    with pytest.raises(QuickdraftError, match="--resume"):
        train(out_b, corpus=corpus_dir, **ARGS)  # a checkpoint is there: refuse to start over
    with pytest.raises(QuickdraftError, match="batch_size"):
        train(out_b, resume=True, corpus=corpus_dir, **{**ARGS, "batch_size": 8})
    mtime = (out_b / "data" / "train.npy").stat().st_mtime_ns
    second = train(out_b, resume=True, verbose=False)  # everything else comes from the checkpoint
    assert second["finished"] and second["step"] == 6
    assert (out_b / "data" / "train.npy").stat().st_mtime_ns == mtime  # not tokenised again
    ckpt_a = torch.load(out_a / "checkpoint.pt", weights_only=True)
    ckpt_b = torch.load(out_b / "checkpoint.pt", weights_only=True)
    assert ckpt_a["log"]["train_loss"] == ckpt_b["log"]["train_loss"]
    assert ckpt_a["log"]["heldout_loss"] == ckpt_b["log"]["heldout_loss"]
    for name, tensor in ckpt_a["model"].items():
        assert torch.equal(tensor, ckpt_b["model"][name]), name
    assert second["heldout_loss"] == summary_a["heldout_loss"]


def test_resume_needs_a_checkpoint(tmp_path):
    with pytest.raises(QuickdraftError, match="no checkpoint.pt"):
        train(tmp_path, resume=True, verbose=False)


def test_reuse_tokenizer(trained, corpus_dir, tmp_path):
    out = tmp_path / "draft"
    # draft-xs defaults to 8192 tokens: the target's config.json (512) wins, as a draft must match
    summary = train(out, corpus=corpus_dir, tokenizer=trained[0], **{**ARGS, "steps": 2, "size": "draft-xs"})
    assert summary["finished"] and json.loads((out / "config.json").read_text())["vocab_size"] == 512
    llm = LLM(target=trained[0], draft=out, num_speculative_tokens=3, device="cpu", policy="fixed")  # same vocabulary
    [result] = llm.generate("def add(a, b):", SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(result.token_ids) == 6
    assert (out / "tokenizer.json").read_bytes() == (trained[0] / "tokenizer.json").read_bytes()
    with pytest.raises(QuickdraftError, match="no tokenizer.json"):
        train(tmp_path / "x", corpus=corpus_dir, tokenizer=tmp_path / "none", **ARGS)


def test_cached_tokens_are_reused(tmp_path):
    class Boom:
        def get_vocab_size(self, with_added_tokens=True):
            raise AssertionError("tokenised again")

    class Fake:
        def get_vocab_size(self, with_added_tokens=True):
            return 10

        def encode_batch(self, texts, add_special_tokens=False):
            return [type("E", (), {"ids": [5, 6]})() for _ in texts]

    path = tmp_path / "data" / "train.npy"
    a = cached_tokens(path, "key", Fake(), ["x", "y"], 0, 1)
    assert a.tolist() == [0, 5, 6, 1, 0, 5, 6, 1] and a.dtype == np.uint16
    assert cached_tokens(path, "key", Boom(), ["x", "y"], 0, 1).tolist() == a.tolist()
    assert cached_tokens(path, "other", Fake(), ["x"], 0, 1).tolist() == [0, 5, 6, 1]
