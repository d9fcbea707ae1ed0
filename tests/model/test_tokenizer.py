"""Tokenizer folder handling: encode/decode, chat template, eos ids, incremental detokenizer."""

from __future__ import annotations

import json

import pytest

from quickdraft import QuickdraftError
from quickdraft.model.tokenizer import Detokenizer, Tokenizer, eos_token_ids

from conftest import write_tokenizer


@pytest.fixture()
def tok_dir(tmp_path):
    write_tokenizer(tmp_path)
    return tmp_path


def test_encode_adds_bos_and_roundtrips(tok_dir):
    tok = Tokenizer(tok_dir)
    ids = tok.encode("def add(a, b):")
    assert ids[0] == tok.bos_token_id == 0
    assert tok.decode(ids) == "def add(a, b):"
    assert tok.encode("x", add_special_tokens=False)[0] != 0


def test_chat_template(tok_dir):
    tok = Tokenizer(tok_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|user|>hi</s><|assistant|>"
    assert tok.encode_chat([{"role": "user", "content": "hi"}]) == tok.encode(text, add_special_tokens=False)


def test_missing_chat_template_is_clear(tmp_path):
    write_tokenizer(tmp_path, chat_template=None)
    with pytest.raises(QuickdraftError, match="no chat template"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_raise_exception_is_clear(tmp_path):
    write_tokenizer(tmp_path, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(QuickdraftError, match="roles must alternate"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_eos_ids_from_generation_config_list(tmp_path):
    write_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 1, 9]}))
    assert eos_token_ids(tmp_path) == (7, 1, 9)


def test_eos_falls_back_to_tokenizer(tmp_path):
    write_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert eos_token_ids(tmp_path, Tokenizer(tmp_path)) == (1,)
    assert eos_token_ids(tmp_path) == ()


def test_from_dir_without_tokenizer(tmp_path):
    assert Tokenizer.from_dir(tmp_path) is None


def test_detokenizer_is_incremental_and_handles_split_characters(tok_dir):
    tok = Tokenizer(tok_dir)
    text = "Hello ✓ 日本語 world"
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("x")
    detok = Detokenizer(tok, prompt)
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
