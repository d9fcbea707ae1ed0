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
    spec = LLM(target, draft=draft, num_speculative_tokens=3, policy="fixed").generate(["def add(a, b):"], params)[0].token_ids
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


def test_topk_kl_is_the_full_kl_when_k_covers_the_vocabulary():
    from quickdraft.train.distill import topk_kl_loss

    torch.manual_seed(0)
    teacher, student = torch.randn(2, 3, 11), torch.randn(2, 3, 11)
    log_p_all = teacher.log_softmax(-1)
    full = (log_p_all.exp() * (log_p_all - student.log_softmax(-1))).sum(-1).mean()
    top, ids = log_p_all.topk(11, -1)
    assert torch.allclose(topk_kl_loss(student, top.half(), ids.int()), full, atol=2e-3)
    top, ids = log_p_all.topk(4, -1)  # the tail lumped into one outcome: a lower bound, zero when equal
    assert 0 <= topk_kl_loss(student, top.half(), ids.int()) <= full + 1e-3
    assert topk_kl_loss(teacher, top.half(), ids.int()).abs() < 2e-3


def test_project_embedding_keeps_the_leading_directions():
    from quickdraft.train.distill import project_embedding

    torch.manual_seed(0)
    model = torch.nn.Module()  # only what project_embedding reads: model.model.embed_tokens
    model.model = torch.nn.Module()
    low_rank = torch.randn(50, 3) @ torch.randn(3, 8)  # rank 3 in 8 dimensions
    model.model.embed_tokens = torch.nn.Embedding.from_pretrained(low_rank)
    projected = project_embedding(model, 3)
    assert projected.shape == (50, 3)
    assert torch.allclose(projected @ projected.T, low_rank @ low_rank.T, atol=1e-3)  # inner products kept
    with pytest.raises(QuickdraftError, match="exceeds the target's"):
        project_embedding(model, 9)


def _gguf_helpers():
    """The tiny-GGUF writer of tests/model/test_gguf.py (llama.cpp's layout, a ChatML template)."""
    import importlib.util
    from pathlib import Path

    pytest.importorskip("gguf")
    spec = importlib.util.spec_from_file_location("gguf_test_helpers", Path(__file__).parents[1] / "model" / "test_gguf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_distill_from_a_gguf_chat_target_on_its_answers(pair, tmp_path, monkeypatch):
    """A .gguf target (any model source goes through resolve_model), a chat template, so the
    draft trains on the target's answers to the instructions, on precomputed top-k distributions,
    from the target's projected embedding."""
    corpus = pair[0]
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    helpers = _gguf_helpers()
    gguf_file = helpers.write_gguf(tmp_path / "chat.gguf", helpers.hf_model(
        "llama", helpers.vocab_size("gpt2"), tie_word_embeddings=True), "llama")
    out = tmp_path / "draft"
    summary = distill(str(gguf_file), out, corpus=corpus, **{**DISTILL, "steps": 12, "pool_prompts": 6,
                                                               "eval_prompts": 2}, teacher_topk=8, teacher_windows=24,
                      init="target-embedding", save_every=5)
    log = json.loads((out / "distill_log.json").read_text())
    assert log["args"]["instructions"] and log["args"]["teacher_topk"] == 8 and log["args"]["teacher_windows"] == 24
    assert log["data"]["instructions"] == 6 and log["eval_kind"] == "held-out instructions"
    assert log["kl_curve"][-1] < log["kl_curve"][0]
    assert "chat instructions" in (out / "README.md").read_text()
    assert 0.0 <= summary["acceptance_after"]["acceptance_rate"] <= 1.0
    llm = LLM(str(gguf_file), draft=out, num_speculative_tokens=3, policy="fixed")  # the vocabulary check passes
    plain = LLM(str(gguf_file), method="none")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    messages = [{"role": "user", "content": "def add(a, b):"}]
    assert llm.chat(messages, params)[0].token_ids == plain.chat(messages, params)[0].token_ids
    with pytest.raises(QuickdraftError, match="unknown --init"):
        distill(str(gguf_file), tmp_path / "o4", corpus=corpus, **DISTILL, init="pca")
    with pytest.raises(QuickdraftError, match="needs a target with a chat template"):
        distill(pair[1], tmp_path / "o5", corpus=corpus, **DISTILL, instructions=True)


def test_instructions_are_distinct_and_held_out():
    from quickdraft.train.instructions import HELDOUT, INSTRUCTIONS

    assert 150 <= len(INSTRUCTIONS) <= 300 and len(HELDOUT) >= 20
    assert len(set(INSTRUCTIONS)) == len(INSTRUCTIONS) and not set(INSTRUCTIONS) & set(HELDOUT)


def test_composed_instructions_are_many_distinct_and_never_held_out():
    from quickdraft.bench.workloads import CHAT_PROMPTS
    from quickdraft.train.instructions import HELDOUT, INSTRUCTIONS, chat_instructions, composed_instructions

    many = chat_instructions(3000)
    assert len(set(many)) == 3000 and many[:len(INSTRUCTIONS)] == list(INSTRUCTIONS)
    assert not set(many) & (set(HELDOUT) | set(CHAT_PROMPTS))
    assert composed_instructions(50, seed=3) == composed_instructions(50, seed=3) != composed_instructions(50)
