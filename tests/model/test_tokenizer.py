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


def test_token_bytes_spell_the_text_byte_level(tmp_path):
    """OpenAI's logprobs `bytes`: a byte-level vocabulary's tokens are its bytes, so the tokens
    of a text (multi-byte characters split across tokens included) join to the text's UTF-8."""
    from quickdraft.llm import default_model_dirs

    tok = Tokenizer(default_model_dirs()[0])
    for text in ["h\u00e9llo w\u00f6rld \u2713 \u65e5\u672c\n\tx", "def f(x):\n    return x"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert tok.token_bytes(tok.eos_token_id) == tok.eos_token.encode()  # special tokens as written


def test_token_bytes_sentencepiece_style(tmp_path):
    """A SentencePiece vocabulary ("\u2581" for a space, <0xNN> byte fallback: Llama 2, Mistral)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x0A>": 3, "<0xC3>": 4, "<0xA9>": 5, "\u2581hi": 6, "x": 7}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.add_special_tokens(["<s>", "</s>"])
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path)
    assert [tok.token_bytes(i) for i in (6, 3, 4, 5, 7, 1)] == [b" hi", b"\n", b"\xc3", b"\xa9", b"x", b"<s>"]
    assert tok.token_text(4) == "\ufffd" and tok.token_text(6) == " hi"
