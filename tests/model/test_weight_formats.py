"""Inference weight formats (quickdraft.model.quant, issue 19): each format computes the matmul
of the weights it stores; fusion keeps every projection's output; quantisation errors are bounded."""

from __future__ import annotations

import pytest
import torch

from quickdraft.errors import QuickdraftError
from quickdraft.model.loader import load_model
from quickdraft.model.formats import DENSE_ROWS, Int8BlockedLinear, int4_quantize
from quickdraft.model.quant import (blocked_supported, make_linear, onednn_bf16_supported, prepare, weight_bytes,
                                    weight_format)

FORMATS = (["dense", "transposed", "int8", "int4"] + (["onednn"] if onednn_bf16_supported() else [])
           + (["blocked", "blocked_bf16"] if blocked_supported() else []))


def linears(dtype=torch.float32, bias=True):
    torch.manual_seed(0)
    return [torch.nn.Linear(64, n, bias=bias).to(dtype) for n in (96, 32, 32)]


@pytest.mark.parametrize("fmt", FORMATS)
# (x2: rows of 2) past PyTorch's int8 / int4 switch to a dense GEMM (16 rows) and past 64, where
# quickdraft's int8 / int4 kernels once switched too
@pytest.mark.parametrize("rows", [1, 5, DENSE_ROWS + 3, 40])
def test_fused_linear_computes_each_projection(fmt, rows):
    dtype = torch.bfloat16 if fmt in ("onednn", "blocked_bf16") else torch.float32
    lins = linears(dtype)
    fused = make_linear(lins, fmt)
    x = torch.randn(rows, 2, 64).to(dtype)
    parts = fused(x).split(fused.splits, dim=-1)
    assert fused.splits == [96, 32, 32] and fused(x).dtype == dtype
    for lin, part in zip(lins, parts):
        ref = lin(x).float()
        tol = {"dense": 1e-5, "transposed": 1e-5, "blocked": 1e-5, "onednn": 0.03, "blocked_bf16": 0.03, "int8": 0.03,
               "int4": 0.2}[fmt]
        assert (part.float() - ref).abs().max() <= tol * ref.abs().max()
    if fmt != "onednn":  # the stored weight is what the matmul uses
        w = fused.dequantized(torch.float32)
        b = torch.cat([lin.bias for lin in lins]).float()
        exact = x.float() @ w.t() + b
        tol = 1e-5 if fmt in ("dense", "transposed", "blocked") else 0.02  # bf16 activations / outputs
        assert (fused(x).float() - exact).abs().max() <= tol * exact.abs().max()


def test_int4_error_is_within_half_a_step_per_group():
    w = torch.randn(16, 128)
    q, scale, zero = int4_quantize(w)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scale.shape == (16, 4)
    deq = ((q.float().unflatten(1, (4, 32)) - 8) * scale[..., None] + zero[..., None]).flatten(1)
    assert ((deq - w).abs().unflatten(1, (4, 32)) <= scale[..., None] / 2 + 1e-6).all()
    with pytest.raises(QuickdraftError, match="divisible by 32"):
        int4_quantize(torch.randn(4, 40))


def test_format_choice_and_unknown_quantization():
    cpu = torch.device("cpu")
    assert weight_format(cpu, torch.float32, None) == ("blocked" if blocked_supported() else "transposed")
    assert weight_format(cpu, torch.float16, "none") == "dense"
    assert weight_format(torch.device("cuda"), torch.bfloat16, None) == "dense"
    assert weight_format(cpu, torch.float32, "int4") == "int4"
    with pytest.raises(QuickdraftError, match="unknown quantization 'int3'; choose one of none, int8, int4"):
        weight_format(cpu, torch.float32, "int3")


def test_prepared_model_gives_the_same_logits_and_the_checkpoint_keeps_its_names(target_dir):
    ref = load_model(target_dir)
    names = set(ref.state_dict())
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"} <= names
    ids = torch.randint(0, ref.config.vocab_size, (2, 7))
    want = ref(ids)
    model = prepare(load_model(target_dir))
    assert torch.allclose(model(ids), want, atol=1e-4)
    assert weight_bytes(prepare(load_model(target_dir), "int8")) < weight_bytes(load_model(target_dir)) / 2
    assert set(load_model(target_dir).state_dict()) == names  # loading is untouched by preparing


def test_bytes_read_per_token_counts_each_format(target_dir):
    from quickdraft.model.quant import bytes_read_per_token

    plain = load_model(target_dir)
    cfg = plain.config
    linear = sum(m.weight.numel() for m in plain.modules() if isinstance(m, torch.nn.Linear))
    small = sum(p.numel() for n, p in plain.named_parameters() if "norm" in n)
    assert bytes_read_per_token(plain) == 4 * (linear + small + (0 if cfg.tie_word_embeddings else cfg.hidden_size))
    f32 = prepare(load_model(target_dir))
    assert bytes_read_per_token(f32) == 4 * (linear + small + cfg.hidden_size)  # lm_head its own copy
    int8 = prepare(load_model(target_dir), "int8")
    rows = sum(m.weight.shape[0] for m in plain.modules() if isinstance(m, torch.nn.Linear))
    scale_bytes = 4 if isinstance(int8.lm_head, Int8BlockedLinear) else 2  # float32 scales for quickdraft's kernel, bf16 for PyTorch's
    assert bytes_read_per_token(int8) == linear + scale_bytes * rows + 4 * (small + cfg.hidden_size)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantised_linear_without_a_kernel_dequantises(fmt, monkeypatch):
    """A device without PyTorch's weight-only kernel (int8 / int4 on CUDA) gets the same
    product from the dequantised weight, and says so in its repr."""
    monkeypatch.setattr("quickdraft.model.formats.has_kernel", lambda op, device: False)
    monkeypatch.setenv("QUICKDRAFT_KERNELS", "0")  # nor quickdraft's own
    lins = linears()
    fallback = make_linear(lins, fmt)
    assert not fallback.kernel and "dequantised per call" in repr(fallback)
    x = torch.randn(3, 64)
    exact = x @ fallback.dequantized(torch.float32).t() + torch.cat([lin.bias for lin in lins])
    assert (fallback(x) - exact).abs().max() <= 0.02 * exact.abs().max()  # bf16 activations on CPU


def _int8_whole(w):  # the quantisers' definitions, on the whole tensor at once
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def _int4_whole(w, group=32):
    wg = w.float().reshape(w.shape[0], -1, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = (hi - lo).clamp(min=1e-8) / 15
    q = torch.clamp(torch.round((wg - lo[..., None]) / scale[..., None]), 0, 15).to(torch.uint8)
    return q.reshape(w.shape), scale, lo + 8 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantisers_give_the_whole_tensor_bits_chunk_by_chunk(dtype, monkeypatch):
    """int8_quantize / int4_quantize work through a weight a few rows at a time, in place on
    float32 copies: the same bits as their whole-tensor definitions, the weight left as it was."""
    from quickdraft.model import formats

    monkeypatch.setattr(formats, "_QUANT_CHUNK", 3 * 96 + 5)  # 3 rows a chunk: 37 rows end mid-chunk
    torch.manual_seed(0)
    w = (torch.randn(37, 96) * 0.05).to(dtype)
    w[4] = 0  # an all-zero row: the scale floor
    w[7, :32] = 0.25  # a constant group
    w[9, 5] = -3.0  # an outlier sets its row's int8 scale
    before = w.clone()
    for got, want in ((formats.int8_quantize(w), _int8_whole(w)), (formats.int4_quantize(w), _int4_whole(w))):
        assert all(torch.equal(g, x) for g, x in zip(got, want))
    assert torch.equal(w, before)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_bf16_checkpoint_is_quantised_from_its_own_bits(quantization, tmp_path):
    """A 16-bit checkpoint loaded as float32 for int8 / int4 keeps its linear weights 16-bit until
    `prepare` quantises them (no float32 copy of the model): the same quantised weights and logits
    as quantising its float32 copy, the rest of the model in float32."""
    from conftest import make_checkpoint

    folder = make_checkpoint(tmp_path / "bf16", torch_dtype="bfloat16")
    model = load_model(folder, dtype="float32", quantization=quantization)
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16  # (until prepare)
    assert model.dtype == torch.float32 and model.model.norm.weight.dtype == torch.float32
    fast = prepare(model, quantization)
    slow = prepare(load_model(folder, dtype="float32"), quantization)
    for a, b in zip(fast.buffers(), slow.buffers()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    ids = torch.tensor([[3, 5, 7, 11]])
    assert torch.equal(fast(ids), slow(ids))
