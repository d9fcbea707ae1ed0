"""GGUF loading (quickdraft.model.gguf): weights, config, tokenizer and chat template against
transformers' own GGUF loading, on tiny GGUFs written here the way llama.cpp's converter writes them."""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from quickdraft import LLM, QuickdraftError, SamplingParams, UnsupportedModelError, kernels
from quickdraft.model.gguf import GGUF_POINTER, convert_gguf, read_gguf
from quickdraft.model.loader import checkpoint_dir, load_model
from quickdraft.model import quant
from quickdraft.model.quant import blocked_supported
from quickdraft.model.tokenizer import Tokenizer, eos_token_ids

gguf = pytest.importorskip("gguf")
torch.set_num_threads(1)
Q = gguf.GGMLQuantizationType

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)  # 2024 numbers 1234567\n",
    "The quick brown fox jumps over the lazy dog. Hello world! Ünïcödé ✓ 日本語 🙂\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    main()\n",
    "It's a test, isn't it? We'll see. They're here; you've got mail.\n",
]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SP_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
               "{% if add_generation_prompt %}[assistant]{% endif %}")
TEXTS = ["Hello world", "  leading spaces\tand\ttabs\n\n\nnewlines   ", "Ünïcödé ✓ 日本語 🙂 naïve café", "",
         " ", "def f(x):\n    return x ** 2  # 12345 67\n", "<|im_start|>user\nhi<|im_end|>", "a\r\nb",
         "<s>x</s> <unk> <think>a</think> <|user|> hello", "It's isn't we'll THEY'RE", "\u2581 already \u2581\u2581"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there  ✓"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "def f(): pass"}]


# --- tiny GGUFs, written as llama.cpp's convert_hf_to_gguf.py writes them ---------------------

@functools.cache
def gpt2_vocab() -> tuple[list[str], list[int], list[str]]:
    """tokens, token types, merges of a small byte-level BPE (like a Qwen or SmolLM GGUF's)."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get) + ["<think>"]  # a user-defined token
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    types = [3 if t in specials else 4 if t == "<think>" else 1 for t in tokens]
    return tokens, types, merges


@functools.cache
def sp_vocab() -> tuple[list[str], list[float], list[int]]:
    """tokens, scores, token types of a small SentencePiece BPE (like a Llama 2 or Mistral GGUF's)."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    model = json.loads(tok.to_str())["model"]
    merged = list(dict.fromkeys("".join(m) if isinstance(m, list) else m.replace(" ", "") for m in model["merges"]))
    chars = [t for t in sorted(model["vocab"], key=model["vocab"].get) if t not in set(merged)]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "<|user|>", *merged, *chars]
    types = [2, 3, 3] + [6] * 256 + [4] + [1] * (len(merged) + len(chars))
    scores = [0.0] * 260 + [-float(r) for r in range(len(merged))] + [-1000.0 - j for j in range(len(chars))]
    return tokens, scores, types


def hf_model(kind: str, vocab: int, seed: int = 0, **overrides):
    """A random transformers model with non-trivial norms and biases (so a mix-up shows)."""
    import transformers

    classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
    if kind == "qwen3":
        kw["head_dim"] = 128  # transformers' GGUF loader ignores qwen3's key_length and takes this default
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(classes[kind](**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
# K-quants: (bytes per 256-value block, offsets of the fp16 super-block scales)
K_LAYOUT = {"Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)),
            "Q6_K": (210, (208,))}


def gguf_tensor_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[part]}.{kind}"


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rotary halves interleaved into pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(qtype: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with small finite scales, (rows, bytes per row): the package cannot quantise these."""
    size, scales_at = K_LAYOUT[qtype]
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    for at in scales_at:
        blocks[:, at:at + 2] = rng.uniform(1e-5, 4e-5, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, cols // 256 * size)


def write_gguf(path: Path, model, arch: str, *, tokenizer: str | None = "gpt2", qtype: str = "F32",
               extra=None, seed: int = 0, head_qtype: str | None = None, kept: dict[str, str] | None = None) -> Path:
    """`model` as llama.cpp writes it: metadata, the tokenizer, q/k rows permuted for llama,
    1-D tensors in F32 and matrices in `qtype` (the embedding and output in `head_qtype` when
    given, as llama.cpp's quantizer keeps them wider; a tensor whose GGUF name ends with a key of
    `kept` in that type, as a Q4_K_M file keeps some layers' attn_v in Q6_K)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base((cfg.rope_parameters or {}).get("rope_theta", 10000.0))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if tokenizer == "gpt2":
        tokens, types, merges = gpt2_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(0)
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML)
    elif tokenizer == "llama":
        tokens, scores, types = sp_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_chat_template(SP_TEMPLATE)
    if extra is not None:
        extra(w)
    rng = np.random.default_rng(seed)
    matrices = qtype
    for hf, t in model.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no copy of a tied head
        arr = t.float().numpy()
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            arr = llama_permute(arr, cfg.num_attention_heads if ".q_proj." in hf else cfg.num_key_value_heads)
        name = gguf_tensor_name(hf)
        qtype = head_qtype if head_qtype and name in ("token_embd.weight", "output.weight") else matrices
        qtype = next((kind for end, kind in (kept or {}).items() if name.endswith(end)), qtype)
        if arr.ndim == 1 or qtype == "F32":
            w.add_tensor(name, arr.astype(np.float32))
        elif qtype == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        elif qtype in K_LAYOUT:
            w.add_tensor(name, random_blocks(qtype, arr.shape, rng), raw_dtype=Q[qtype])
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, Q[qtype]), raw_dtype=Q[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def vocab_size(tokenizer: str) -> int:
    return len(gpt2_vocab()[0] if tokenizer == "gpt2" else sp_vocab()[0])


def hf_from_gguf(path: Path):
    """transformers' own GGUF loading, float32."""
    pytest.importorskip("accelerate", reason="transformers loads GGUF models only with accelerate")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def hf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def chat_ids(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# --- weights ------------------------------------------------------------------------------------

WIDE = dict(hidden_size=256, intermediate_size=512)  # K-quant rows hold whole 256-value blocks
CASES = {  # arch, tensor type, tokenizer, model overrides
    "llama-F32": ("llama", "F32", "gpt2", {}),
    "llama-F16-tied-sentencepiece": ("llama", "F16", "llama", dict(tie_word_embeddings=True)),
    "qwen2-BF16": ("qwen2", "BF16", "gpt2", {}),
    "qwen3-F32": ("qwen3", "F32", "gpt2", {}),
    "llama-Q8_0": ("llama", "Q8_0", "gpt2", {}),
    "qwen2-Q4_0": ("qwen2", "Q4_0", "gpt2", {}),
    "qwen3-Q4_1": ("qwen3", "Q4_1", "gpt2", {}),
    "llama-Q5_0": ("llama", "Q5_0", "llama", {}),
    "qwen2-Q5_1": ("qwen2", "Q5_1", "gpt2", {}),
    "llama-Q4_K": ("llama", "Q4_K", "gpt2", WIDE),
    "qwen2-Q5_K": ("qwen2", "Q5_K", "gpt2", WIDE),
    "qwen3-Q6_K": ("qwen3", "Q6_K", "gpt2", WIDE),
    "llama-Q2_K": ("llama", "Q2_K", "gpt2", WIDE),
    "llama-Q3_K": ("llama", "Q3_K", "gpt2", WIDE),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_gguf_loading(tmp_path, case):
    arch, qtype, tokenizer, overrides = CASES[case]
    source = hf_model(arch, vocab_size(tokenizer), **overrides)
    path = write_gguf(tmp_path / f"{case}.gguf", source, arch, tokenizer=tokenizer, qtype=qtype)
    ours = load_model(path, dtype="float32")
    ids = torch.randint(0, vocab_size(tokenizer), (2, 24), generator=torch.Generator().manual_seed(0))
    got = logits(ours, ids)
    assert (got - logits(hf_from_gguf(path), ids)).abs().max().item() <= 1e-4
    if qtype == "F32":  # and the permutation is undone exactly: the model the file was written from
        assert (got - logits(source, ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("qtype", list(K_LAYOUT))
def test_k_quant_dequantisation_matches_transformers_kernels(tmp_path, qtype):
    """The gguf package's numpy dequantiser (what we use) against transformers' own torch kernels."""
    dequant = pytest.importorskip("transformers.integrations.gguf.dequant")
    source = hf_model("llama", vocab_size("gpt2"), **WIDE)
    path = write_gguf(tmp_path / "k.gguf", source, "llama", qtype=qtype)
    tensor = read_gguf(path).tensors["blk.0.ffn_up.weight"]
    theirs = dequant.dequantize(torch.from_numpy(np.array(tensor.data)).reshape(-1), int(tensor.tensor_type))
    ours = load_model(path, dtype="float32").model.layers[0].mlp.up_proj.weight
    assert torch.equal(ours.reshape(-1), theirs)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_our_reader_and_dequantisers_match_the_gguf_package(tmp_path, qtype):
    """The header parser and the torch dequantisers (F16/BF16/Q8_0/Q4_0/Q4_1) against the gguf
    package's reader and numpy dequantisers, bit for bit, metadata included."""
    from quickdraft.model.gguf import _dequantize

    rng = np.random.default_rng(3)
    arr = rng.standard_normal((64, 256)).astype(np.float32) * 0.1

    def tensors(w):
        w.add_array("test.floats", [0.5, -1.25])
        w.add_array("test.nested", [[1, 2], [3]])
        if qtype in K_LAYOUT:
            w.add_tensor("test.q", random_blocks(qtype, arr.shape, rng), raw_dtype=Q[qtype])
        elif qtype == "BF16":
            w.add_tensor("test.q", gguf.quants.quantize(arr, Q.BF16), raw_dtype=Q.BF16)
        else:
            w.add_tensor("test.q", gguf.quants.quantize(arr, Q[qtype]), raw_dtype=Q[qtype])

    path = write_gguf(tmp_path / "r.gguf", hf_model("llama", vocab_size("gpt2")), "llama", extra=tensors)
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    theirs_meta = {name: f.contents() for name, f in theirs.fields.items() if not name.startswith("GGUF.")}
    assert theirs_meta.pop("test.nested") == [1, 2, 3]  # the gguf reader flattens nested arrays
    assert ours.metadata.pop("test.nested") == [[1, 2], [3]]
    assert ours.metadata == theirs_meta
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.tensor_type == t.tensor_type and mine.shape == tuple(int(d) for d in t.shape)
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        assert torch.equal(_dequantize(mine), want.reshape(mine.hf_shape)), t.name


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_4bit_blocks_load_into_int4_as_they_are(tmp_path, qtype):
    """Q4_0 / Q4_1 / Q4_K matrices become the int4 format's (q, scale, zero) without re-quantising:
    the same values as the dequantised file, up to float rounding and the kernel's bf16 scales;
    and the quantised target's speculative output equals its own plain output."""
    from quickdraft.model.gguf import _dequantize, int4_groups
    from quickdraft.model.formats import FastLinear

    source = hf_model("llama", vocab_size("gpt2"), **WIDE)
    path = write_gguf(tmp_path / "q4.gguf", source, "llama", qtype=qtype)
    g = read_gguf(path)
    for t in g.tensors.values():
        groups = int4_groups(t)
        assert (groups is None) == (t.tensor_type.name != qtype)
        if groups is not None:
            q, scale, zero = groups
            assert q.dtype == torch.uint8 and int(q.max()) <= 15
            w = ((q.float() - 8).unflatten(1, (-1, 32)) * scale[..., None] + zero[..., None]).flatten(1)
            assert torch.allclose(w, _dequantize(t), rtol=0, atol=1e-6 * float(_dequantize(t).abs().max()))
    llm = LLM(target=path, draft=path, dtype="float32", quantization="int4", draft_quantization="int4",
              num_speculative_tokens=3, policy="fixed")
    for m in llm.target.model.layers.modules():  # every layer matrix was written in qtype
        if isinstance(m, FastLinear):
            assert m.fmt == "int4" and "from GGUF blocks" in repr(m), repr(m)
    ref = load_model(path, dtype="float32").model.layers[0].mlp.up_proj.weight
    up = llm.target.model.layers[0].mlp.gate_up_proj
    assert "from GGUF blocks" in repr(up)
    got = up.dequantized(torch.float32)[up.splits[0]:]
    assert (got - ref).abs().max() <= 2 ** -7 * ref.abs().max()  # bf16 scales: 8 significant bits
    if qtype == "Q4_K" and blocked_supported():  # the float16 layout by default; super-blocks on request
        assert not kernels.int4_super(up.qpacked)
        with quant.int4_super_blocks(True):  # its codes and factors as they are: the file's values exactly,
            sup = LLM(target=path, draft=path, dtype="float32", quantization="int4",  # and lossless speculation
                      draft_quantization="int4", num_speculative_tokens=3, policy="fixed")
            sup_plain = LLM(target=path, dtype="float32", quantization="int4", policy="fixed")
        sup_up = sup.target.model.layers[0].mlp.gate_up_proj
        assert kernels.int4_super(sup_up.qpacked) and torch.equal(sup_up.dequantized(torch.float32)[up.splits[0]:], ref)
        p, sp = [5, 9, 14, 3], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        assert sup.generate([p], sp)[0].token_ids == sup_plain.generate([p], sp)[0].token_ids
    prompt, params = [5, 9, 14, 3], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = LLM(target=path, dtype="float32", quantization="int4", policy="fixed")
    assert llm.generate([prompt], params)[0].token_ids == plain.generate([prompt], params)[0].token_ids


def test_4bit_layer_matrices_are_dequantised_only_where_a_format_needs_them(tmp_path):
    """Under quantization="int4" a linear layer's 4-bit matrix is not dequantised at load (a
    placeholder of its shape, no memory; llama.cpp's 1.7B Q4_0 file loaded in 6 s, not 24, peak
    memory 3.1 GB, not 4.6 with its blocks unpacked all at once): the
    blocks run as they are, a Q4_0 matrix in the symmetric layout (no offsets); where a fused
    projection mixes it with a wider matrix (a Q4_K_M file's attn_v), its float weight is read then.
    Every packed weight equals the one built from a load that dequantised everything, and no
    placeholder is left in the prepared model."""
    from quickdraft.model.build import assemble
    from quickdraft.model.formats import FastLinear
    from quickdraft.model.gguf import gguf_state_dict, hf_config, mark_wide
    from quickdraft.config import ModelConfig
    from quickdraft.model.quant import blocked_supported, prepare

    if not blocked_supported():
        pytest.skip("quickdraft's CPU kernels do not run here: a 4-bit GGUF is dequantised")
    path = write_gguf(tmp_path / "m.gguf", hf_model("llama", vocab_size("gpt2")), "llama", qtype="Q4_0",
                      head_qtype="Q8_0", kept={"attn_v.weight": "Q8_0"})
    loaded = load_model(path, dtype="float32", quantization="int4")
    attn = loaded.model.layers[0].self_attn
    assert attn.q_proj.weight.stride() == (0, 0) and attn.q_proj.weight.gguf_deferred is not None
    assert callable(attn.q_proj.weight.gguf_int4)  # its blocks too are read when a layer is built
    assert attn.v_proj.weight.stride() != (0, 0) and getattr(attn.v_proj.weight, "gguf_deferred", None) is None
    assert loaded.model.embed_tokens.weight.abs().sum() > 0  # the embedding is read
    model = prepare(loaded, "int4")
    assert not any(getattr(p, "gguf_deferred", None) is not None or 0 in p.stride() for p in model.parameters())

    g = read_gguf(path)  # the reference: everything dequantised at load, as before
    cfg = ModelConfig.from_hf(hf_config(g))
    int4: dict = {}
    ref = assemble(cfg, gguf_state_dict(g, cfg, torch.float32, "cpu", int4), g.path)
    for name, groups in int4.items():
        ref.get_parameter(name).gguf_int4 = groups
    mark_wide(ref)
    ref = prepare(ref, "int4")
    mine = {n: m for n, m in model.named_modules() if isinstance(m, FastLinear)}
    theirs = {n: m for n, m in ref.named_modules() if isinstance(m, FastLinear)}
    assert mine.keys() == theirs.keys()
    for name, m in mine.items():
        assert repr(m) == repr(theirs[name])
        for a, b in zip(m._read(), theirs[name]._read(), strict=True):
            assert torch.equal(a, b), name
    layer = mine["model.layers.0.mlp.gate_up_proj"]
    assert layer.fmt == "int4" and layer.qpacked.shape[-1] == 1152  # Q4_0: the symmetric layout
    assert mine["model.layers.0.self_attn.qkv_proj"].fmt == "int8"  # q / k Q4_0 beside a Q8_0 v: read


def test_a_4bit_gguf_runs_on_its_own_blocks_by_default(tmp_path):
    """With no quantization asked, a GGUF stored in 4 bits keeps its blocks on the int4 kernel
    (where quickdraft's kernels run), its wider lm_head runs int8 (not rounded to 4 bits again),
    a draft model stored in 4 bits does the same, speculation still gives the plain output, and
    quantization="none" dequantises as before; a GGUF stored in 8 bits is dequantised."""
    from quickdraft.model.formats import FastLinear
    from quickdraft.model.quant import blocked_supported

    if not blocked_supported():
        pytest.skip("quickdraft's CPU kernels do not run here: a 4-bit GGUF is dequantised")
    vocab = vocab_size("gpt2")
    target = write_gguf(tmp_path / "t.gguf", hf_model("llama", vocab, **WIDE), "llama", qtype="Q4_1",
                        head_qtype="Q8_0")
    draft = write_gguf(tmp_path / "d.gguf", hf_model("llama", vocab, seed=1, num_hidden_layers=1), "llama",
                       qtype="Q4_0")
    q8 = write_gguf(tmp_path / "q8.gguf", hf_model("llama", vocab, seed=2), "llama", qtype="Q8_0")

    def formats(model):
        return {m.fmt for m in model.model.layers.modules() if isinstance(m, FastLinear)}, model.lm_head.fmt

    spec = LLM(target=target, draft=draft, dtype="float32", num_speculative_tokens=3, policy="fixed")
    assert formats(spec.target) == ({"int4"}, "int8") and formats(spec.draft) == ({"int4"}, "int4")
    assert all("from GGUF blocks" in repr(m) for m in spec.target.model.layers.modules()
               if isinstance(m, FastLinear))
    asked = LLM(target=target, method="none", dtype="float32", quantization="int4")
    assert formats(asked.target) == ({"int4"}, "int8")  # asked or not: the same model
    plain = LLM(target=target, method="none", dtype="float32")
    prompt, params = [5, 9, 14, 3, 5, 9], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    out = plain.generate([prompt], params)[0].token_ids
    assert spec.generate([prompt], params)[0].token_ids == out == asked.generate([prompt], params)[0].token_ids
    assert formats(LLM(target=target, method="none", dtype="float32", quantization="none").target) \
        == ({"blocked"}, "blocked")
    assert formats(LLM(target=q8, method="none", dtype="float32").target) == ({"blocked"}, "blocked")


def test_quantised_load_into_half_precision(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", hf_model("qwen2", vocab_size("gpt2")), "qwen2", qtype="Q8_0")
    ref = load_model(path, dtype="float32")
    for dtype in (torch.bfloat16, torch.float16):
        model = load_model(path, dtype=dtype)
        assert model.dtype == dtype
        assert torch.equal(model.model.embed_tokens.weight, ref.model.embed_tokens.weight.to(dtype))


def test_qwen3_head_dim_comes_from_key_length(tmp_path):
    """transformers' GGUF loader ignores qwen3's key_length; we read it (here 32, not the default 128)."""
    source = hf_model("qwen3", vocab_size("gpt2"), head_dim=32)
    path = write_gguf(tmp_path / "q3.gguf", source, "qwen3")
    ours = load_model(path, dtype="float32")
    assert ours.config.head_dim == 32
    ids = torch.randint(0, vocab_size("gpt2"), (1, 16), generator=torch.Generator().manual_seed(1))
    assert (logits(ours, ids) - logits(source, ids)).abs().max().item() <= 1e-4


def llama3_rope_freqs(theta: float, head_dim: int, factor: float, low: float = 1.0, high: float = 4.0,
                      old_len: int = 8192) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors: Llama 3.1's scaling as per-frequency divisors."""
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_from_rope_freqs_tensor(tmp_path):
    """Llama 3.1+ files carry their rope scaling only as rope_freqs.weight (transformers ignores it)."""
    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 10000.0}
    source = hf_model("llama", vocab_size("gpt2"), rope_parameters=rope, max_position_embeddings=131072)
    with torch.no_grad():  # sharp attention, so that positions (and their rotary angles) matter
        for layer in source.model.layers:
            layer.self_attn.q_proj.weight.mul_(10)
            layer.self_attn.k_proj.weight.mul_(10)
    freqs = llama3_rope_freqs(10000.0, 16, 32.0)
    path = write_gguf(tmp_path / "l3.gguf", source, "llama", extra=lambda w: w.add_tensor("rope_freqs.weight", freqs))
    ours = load_model(path, dtype="float32")
    assert ours.config.rope.kind == "llama3" and ours.config.rope.factor == 32.0
    ids = torch.randint(0, vocab_size("gpt2"), (1, 200), generator=torch.Generator().manual_seed(2))
    got = logits(ours, ids)
    assert (got - logits(source, ids)).abs().max().item() <= 1e-4
    plain = write_gguf(tmp_path / "plain.gguf", source, "llama")  # the scaling matters at these positions
    assert (got - logits(load_model(plain, dtype="float32"), ids)).abs().max().item() > 1e-2

    odd = write_gguf(tmp_path / "odd.gguf", source, "llama",
                     extra=lambda w: w.add_tensor("rope_freqs.weight", np.linspace(1, 3, 8, dtype=np.float32)))
    with pytest.raises(UnsupportedModelError, match="rope_freqs.weight is not a Llama 3 rope schedule"):
        load_model(odd)


# --- tokenizer and chat template ------------------------------------------------------------------

@pytest.mark.parametrize("tokenizer,arch", [("gpt2", "llama"), ("gpt2", "qwen2"), ("llama", "llama")])
def test_tokenizer_and_chat_ids_match_transformers(tmp_path, tokenizer, arch):
    path = write_gguf(tmp_path / "t.gguf", hf_model(arch, vocab_size(tokenizer)), arch, tokenizer=tokenizer)
    ours, ref = Tokenizer(checkpoint_dir(path)), hf_tokenizer(path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text).input_ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert ours.encode_chat(MESSAGES) == chat_ids(ref, MESSAGES)
    assert ours.bos_token == ref.bos_token and ours.eos_token == ref.eos_token
    assert ours.vocab_size == len(ref)


def test_sentencepiece_adds_bos_and_gpt2_does_not(tmp_path):
    sp = write_gguf(tmp_path / "sp.gguf", hf_model("llama", vocab_size("llama")), "llama", tokenizer="llama")
    bpe = write_gguf(tmp_path / "bpe.gguf", hf_model("llama", vocab_size("gpt2")), "llama", tokenizer="gpt2")
    assert Tokenizer(checkpoint_dir(sp)).encode("hi")[0] == 1
    assert Tokenizer(checkpoint_dir(bpe)).encode("hi")[0] != 1


# --- the metadata folder, convert_gguf, LLM ------------------------------------------------------

def test_checkpoint_dir_is_a_cached_metadata_folder(tmp_path, cache):
    def eot(w):
        w.add_eot_token_id(0)

    path = write_gguf(tmp_path / "m.gguf", hf_model("llama", vocab_size("gpt2")), "llama", extra=eot)
    folder = checkpoint_dir(path)
    assert folder.parent == cache / "gguf"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", GGUF_POINTER])
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temporary folder left
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    assert eos_token_ids(folder) == (2, 0)  # eos, then eot: llama.cpp stops on both
    written = (folder / "config.json").stat().st_mtime_ns
    assert checkpoint_dir(path) == folder and (folder / "config.json").stat().st_mtime_ns == written

    ids = torch.arange(10)[None]
    assert torch.equal(logits(load_model(folder), ids), logits(load_model(path), ids))
    os.utime(path, ns=(1, 1))  # another file now: a new folder, and the old one refuses to load
    assert checkpoint_dir(path) != folder
    with pytest.raises(QuickdraftError, match="changed or is gone"):
        load_model(folder)


@pytest.mark.parametrize("arch,tokenizer,qtype", [("llama", "llama", "Q4_0"), ("qwen2", "gpt2", "Q8_0")])
def test_convert_gguf_loads_in_transformers(tmp_path, arch, tokenizer, qtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_gguf(tmp_path / "c.gguf", hf_model(arch, vocab_size(tokenizer)), arch, tokenizer=tokenizer,
                      qtype=qtype)
    out = convert_gguf(path, tmp_path / "hf", dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, vocab_size(tokenizer), (2, 20), generator=torch.Generator().manual_seed(3))
    assert (logits(model, ids) - logits(hf_from_gguf(path), ids)).abs().max().item() <= 1e-4
    tok, ref = AutoTokenizer.from_pretrained(str(out)), hf_tokenizer(path)
    for text in TEXTS:
        assert tok(text).input_ids == ref(text).input_ids, text
    assert chat_ids(tok, MESSAGES) == chat_ids(ref, MESSAGES)
    with pytest.raises(QuickdraftError, match="already exists"):
        convert_gguf(path, out)


def test_llm_generates_from_gguf_target_and_draft(tmp_path):
    vocab = vocab_size("gpt2")
    target = write_gguf(tmp_path / "target.gguf", hf_model("llama", vocab), "llama", qtype="Q8_0")
    draft = write_gguf(tmp_path / "draft.gguf", hf_model("llama", vocab, seed=1, num_hidden_layers=1), "llama",
                       qtype="Q4_0")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(target=str(target), method="none", dtype="float32")
    prompt = plain.encode("def add(a, b):", chat=True)
    out = plain.generate([prompt], params)[0]
    ref = hf_from_gguf(target)
    seq = list(prompt)
    for _ in range(12):  # plain greedy decoding with transformers' GGUF model, eos ignored as above
        seq.append(int(logits(ref, torch.tensor([seq]))[0, -1].argmax()))
    assert out.token_ids == seq[len(prompt):]
    spec = LLM(target=target, draft=draft, dtype="float32", num_speculative_tokens=3, policy="fixed")
    assert spec.generate([prompt], params)[0].token_ids == out.token_ids


# --- bad input -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("good") / "g.gguf"
    return write_gguf(path, hf_model("llama", vocab_size("gpt2")), "llama", qtype="Q8_0").read_bytes()


@pytest.mark.parametrize("damage,message", [
    (lambda b: b"", "is not a GGUF file"),
    (lambda b: bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)), "is not a GGUF file"),
    (lambda b: b"GGUF" + bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)), "truncated or corrupt"),
    (lambda b: b[:1000], "truncated or corrupt"),  # inside the metadata
    (lambda b: b[:len(b) - 100], "truncated or corrupt"),  # inside the last tensor
])
def test_bad_files_are_one_line_errors(tmp_path, good_bytes, damage, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(damage(good_bytes))
    for load in (load_model, checkpoint_dir):
        with pytest.raises(QuickdraftError, match=message) as err:
            load(path)
        assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_unsupported_architecture_is_named(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'gemma2'"):
        load_model(tmp_path / "g.gguf")


def test_unsupported_tensor_type_is_named(tmp_path):
    def iq4(w):  # one tensor in a type we do not read: 18-byte blocks of 32 values
        w.add_tensor("blk.0.extra.weight", np.zeros((4, 18 * 2), dtype=np.uint8), raw_dtype=Q.IQ4_NL)

    path = write_gguf(tmp_path / "iq.gguf", hf_model("llama", vocab_size("gpt2")), "llama", extra=iq4)
    for load in (load_model, checkpoint_dir):
        with pytest.raises(UnsupportedModelError, match="unsupported GGUF tensor type IQ4_NL"):
            load(path)


def test_unsupported_tokenizer_is_named(tmp_path):
    def bert(w):
        w.add_tokenizer_model("bert")
        w.add_token_list(["[PAD]", "a"])

    path = write_gguf(tmp_path / "b.gguf", hf_model("llama", 8), "llama", tokenizer=None, extra=bert)
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF tokenizer model 'bert'"):
        checkpoint_dir(path)
