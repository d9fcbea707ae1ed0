"""quickdraft distill: a tiny draft distilled from a tiny target, end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from quickdraft import LLM, QuickdraftError, SamplingParams, load_model
from quickdraft.train.distill import distill
from quickdraft.train.pretrain import train
from quickdraft.train.prompts import opening_prompts

from test_train import ARGS, write_corpus

DISTILL = dict(size="tiny", steps=30, batch_size=4, seq_len=32, pool_prompts=8, pool_new_tokens=24, eval_prompts=4,
               k=3, eval_every=10, verbose=False)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    corpus = write_corpus(tmp_path_factory.mktemp("corpus"))
    target = tmp_path_factory.mktemp("t") / "target"
    train(target, corpus=corpus, **{**ARGS, "steps": 20})
    draft = tmp_path_factory.mktemp("d") / "draft"
    summary = distill(target, draft, corpus=corpus, **DISTILL)
    return corpus, target, draft, summary


def test_distilled_draft_is_a_valid_pair(pair):
    corpus, target, draft, summary = pair
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "distill_log.json", "README.md"):
        assert (draft / name).exists(), name
    assert (draft / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()
    log = json.loads((draft / "distill_log.json").read_text())
    card = (draft / "README.md").read_text()
    assert "Reproduce" in card and "Held-out loss" in card and f"{log['params']:,}" in card
    assert "Held-out loss" in (target / "README.md").read_text()  # the trainer writes a card too
    assert log["kl_curve"][-1] < log["kl_curve"][0]  # it learned to match the target
    for key in ("acceptance_before", "acceptance_after"):
        assert 0.0 <= summary[key]["acceptance_rate"] <= 1.0
    # loads in quickdraft and transformers alike
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[0, 5, 9, 17]])
    ours = load_model(draft, dtype="float32")(ids)
    ref = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32)(ids).logits
    assert (ours - ref).abs().max().item() <= 1e-3
    # and speculative decoding with the pair is lossless (greedy)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(target, method="none").generate(["def add(a, b):"], params)[0].token_ids
    spec = LLM(target, draft=draft, num_speculative_tokens=3).generate(["def add(a, b):"], params)[0].token_ids
    assert spec == plain


def test_distill_errors(pair, tmp_path):
    corpus, target, draft, _ = pair
    with pytest.raises(QuickdraftError, match="not found"):
        distill(tmp_path / "nope", tmp_path / "out", corpus=corpus, **DISTILL)
    with pytest.raises(QuickdraftError, match="already holds a model"):
        distill(target, draft, corpus=corpus, **DISTILL)
    with pytest.raises(QuickdraftError, match="unknown --size"):
        distill(target, tmp_path / "o2", corpus=corpus, **{**DISTILL, "size": "huge"})
    r = subprocess.run([sys.executable, "-m", "quickdraft.cli", "distill", "--target", str(tmp_path / "nope"),
                        "--out", str(tmp_path / "o3")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr


def test_opening_prompts():
    docs = [("a.py", "x = 1\ndef f(a):\n    return a\n\nclass K:\n    pass\n"), ("b.py", "print(1)\n")]
    prompts = opening_prompts(docs, 10)
    assert sorted(prompts) == sorted(["def f(a):\n    return a\n", "class K:\n    pass\n"])
    assert opening_prompts(docs, 1) in (["def f(a):\n    return a\n"], ["class K:\n    pass\n"])
