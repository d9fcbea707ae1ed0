"""int8 checkpoints in the compressed-tensors layout (quickdraft.model.compressed): written by
quantize_folder, loaded as the float model they stand for (whole, sliced for tensor parallelism,
EAGLE-3 heads), and every other quantisation refused with a clear error."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from quickdraft import LLM, SamplingParams, load_model
from quickdraft.errors import QuickdraftError, UnsupportedModelError
from quickdraft.model import compressed


@pytest.fixture(scope="module")
def int8_dir(target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("int8")
    sizes = compressed.quantize_folder(target_dir, out, group_size=32)
    assert sizes["bytes_after"] < sizes["bytes_before"] / 3  # float32 -> int8 + float16 scales
    return out


def test_quantize_round_trip_error_is_within_half_a_step():
    w = torch.randn(96, 128) * torch.logspace(-2, 1, 128)  # groups of very different magnitude
    q, s = compressed.quantize(w, 32)
    assert q.dtype == torch.int8 and s.dtype == torch.float16 and s.shape == (96, 4)
    back = compressed.dequantize(q, s, torch.float32)
    step = s.float().repeat_interleave(32, dim=1)
    assert ((back - w).abs() <= step * 0.5 + 1e-7).all()
    assert (q.abs() <= 127).all()


def test_loaded_model_is_the_dequantised_checkpoint(target_dir, int8_dir):
    model = load_model(int8_dir)
    with safe_open(str(int8_dir / "model.safetensors"), framework="pt") as f:
        name = "model.layers.0.mlp.down_proj.weight"
        assert f.get_tensor(name).dtype == torch.int8
        want = compressed.dequantize(f.get_tensor(name), f.get_tensor(name + "_scale"), torch.float32)
    assert torch.equal(model.get_parameter(name), want)
    assert torch.equal(model.model.norm.weight, load_model(target_dir).model.norm.weight)  # norms stay as they were
    ids = torch.tensor([[0, 5, 9, 17, 3]])
    ref = load_model(target_dir)(ids)
    assert 0 < (model(ids) - ref).abs().max() < 0.05 * ref.abs().max()  # close to, not equal to, the original


def test_sliced_reads_equal_whole_reads(int8_dir):
    with safe_open(str(int8_dir / "model.safetensors"), framework="pt") as handle:
        f = compressed.Int8Reader(handle, int8_dir)
        assert not any(k.endswith("_scale") for k in f.keys())
        name = "model.layers.1.self_attn.q_proj.weight"
        whole = f.get_tensor(name)
        assert torch.equal(f.get_slice(name)[8:40, :], whole[8:40])
        assert torch.equal(f.get_slice(name)[:, 10:50], whole[:, 10:50])  # columns off the scale groups
        assert f.get_slice(name).get_shape() == list(whole.shape)


def test_speculative_greedy_equals_plain_on_an_int8_checkpoint(int8_dir):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[0, 5, 9, 17], [0, 33, 2, 8, 40, 41]]
    plain = LLM(int8_dir, method="none", compile=False).generate(prompts, params)
    spec = LLM(int8_dir, method="ngram", num_speculative_tokens=3, compile=False, policy="fixed").generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "gptq"}, "quant_method 'gptq'"),
    ({"format": "pack-quantized"}, "format 'pack-quantized'"),
    ({"weights": {"num_bits": 4}}, "only symmetric 8-bit"),
    ({"weights": {"symmetric": False}}, "only symmetric 8-bit"),
    ({"weights": {"strategy": "tensor"}}, "strategy 'tensor'"),
    ({"input_activations": {"num_bits": 8}}, "quantised activations"),
])
def test_other_quantisations_are_clear_errors(int8_dir, tmp_path, change, message):
    for f in int8_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((int8_dir / "config.json").read_text())
    qc, group = cfg["quantization_config"], cfg["quantization_config"]["config_groups"]["group_0"]
    for key, value in change.items():
        if key == "weights":
            group["weights"].update(value)
        elif key == "input_activations":
            group[key] = value
        else:
            qc[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(tmp_path)


def test_mismatched_scales_are_an_error():
    with pytest.raises(QuickdraftError, match="does not match its scales"):
        compressed.dequantize(torch.zeros(4, 30, dtype=torch.int8), torch.ones(4, 4), torch.float32)
    with pytest.raises(QuickdraftError, match="groups of 64"):
        compressed.quantize(torch.randn(4, 96), 64)
