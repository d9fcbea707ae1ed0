"""EAGLE-3 draft heads (Li et al., arXiv 2503.01840): loading and the head's forward.

A head is one Llama decoder layer that drafts from the target's own hidden states:

- `fc` projects the concatenation of the residual stream entering three target layers
  (low, middle, high; 3 x target hidden -> hidden). Those layers are the checkpoint's
  `eagle_aux_hidden_state_layer_ids`, else EAGLE-3's choice (2, L // 2, L - 3) for a target of
  L layers; index L means the stream leaving the last layer.
- The layer's attention reads [input_layernorm(embedding of the token) ;
  hidden_norm(hidden)] (2 x hidden wide); the residual is the hidden input (normed first
  when `norm_before_residual`). Its output before the final norm is the "hidden" the next
  draft step feeds back in place of the projected target states.
- Its own final `norm` and `lm_head` over a reduced draft vocabulary: draft id i is target
  id i + d2t[i]. The token embedding is the target's (not stored in the head, frozen).

Alignment: the pair (target hidden at position p, token at p + 1) sits at position p of the
head's cache, and its output predicts the token at p + 2. Rotary attention depends only on
relative positions, so this matches implementations that number the pairs from 1.

Two folder layouts load: EAGLE-3's own (config `architectures: ["LlamaForCausalLMEagle3"]`,
a Llama config plus `draft_vocab_size`, optional `eagle_config`; weights `midlayer.*`) and
vLLM's `speculators` format (config `speculators_model_type: "eagle3"`,
`transformer_layer_config`; weights `layers.0.*`). Both carry `fc`, `norm`, `lm_head`, `d2t`
and `t2d`; an `embed_tokens.weight` in the folder is ignored (the target's is used).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..cache import CacheView
from ..config import ModelConfig
from ..errors import QuickdraftError, UnsupportedModelError
from . import compressed
from .transformer import MLP, Attention, RMSNorm, attention_inputs, rope_inv_freq

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the head's decoder layer, as a one-layer Llama config (vocab_size = the target's)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...] | None  # target layers read (None: EAGLE-3's default for the target)
    norm_before_residual: bool
    layout: str  # "eagle3" (EAGLE's own folders) or "speculators"

    @classmethod
    def from_file(cls, path: Path) -> Eagle3Config:
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise QuickdraftError(f"cannot read {path}: {exc}") from None
        if not isinstance(cfg, dict):
            raise QuickdraftError(f"{path}: not a JSON object")
        if cfg.get("speculators_model_type") == "eagle3" or "speculators_config" in cfg:
            if cfg.get("speculators_model_type", "eagle3") != "eagle3":
                raise UnsupportedModelError(f"{path}: speculators model type {cfg['speculators_model_type']!r} "
                                            "(quickdraft reads eagle3 heads)")
            layer_cfg, extra, layout = dict(cfg.get("transformer_layer_config") or {}), cfg, "speculators"
            for flag in ("norm_before_fc", "fc_norm", "norm_output"):
                if cfg.get(flag):
                    raise UnsupportedModelError(f"{path}: EAGLE-3 variant with {flag}=true is not supported")
        elif set(cfg.get("architectures") or ()) & set(EAGLE3_ARCHITECTURES):
            layer_cfg, layout = cfg, "eagle3"
            extra = {**cfg, **(cfg.get("eagle_config") or {})}
            if extra.get("use_aux_hidden_state") is False:
                raise UnsupportedModelError(f"{path}: an EAGLE head without auxiliary hidden states (EAGLE-1/2) "
                                            "is not an EAGLE-3 head")
        else:
            raise QuickdraftError(f"{path.parent} is not an EAGLE-3 head folder (config.json names neither "
                                  f"{' / '.join(EAGLE3_ARCHITECTURES[:2])} nor speculators_model_type eagle3)")
        layer_cfg.setdefault("model_type", "llama")
        if layer_cfg["model_type"] != "llama":
            raise UnsupportedModelError(f"{path}: EAGLE-3 heads with a {layer_cfg['model_type']!r} layer are not "
                                        "supported (Llama layers are)")
        layers = layer_cfg.get("num_hidden_layers", 1)
        if layers != 1:
            raise UnsupportedModelError(f"{path}: EAGLE-3 heads with {layers} decoder layers are not supported "
                                        "(the published heads have one)")
        layer = ModelConfig.from_hf({**layer_cfg, "num_hidden_layers": 1, "tie_word_embeddings": False})
        draft_vocab = extra.get("draft_vocab_size") or layer.vocab_size
        aux = extra.get("eagle_aux_hidden_state_layer_ids")
        if aux is not None and (not isinstance(aux, list) or len(aux) != 3
                                or not all(isinstance(i, int) and i >= 0 for i in aux)):
            raise QuickdraftError(f"{path}: eagle_aux_hidden_state_layer_ids must be three layer indices, got {aux!r}")
        return cls(layer=layer, draft_vocab_size=int(draft_vocab),
                   target_hidden_size=int(extra.get("target_hidden_size") or layer.hidden_size),
                   aux_layers=None if aux is None else tuple(aux),
                   norm_before_residual=bool(extra.get("norm_before_residual", False)), layout=layout)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low / middle / high choice for a target of `num_layers` layers."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over [norm(embedding) ; norm(hidden)]."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool):
        super().__init__()
        d = cfg.hidden_size
        self.self_attn = Attention(cfg)
        a = self.self_attn
        a.q_proj = nn.Linear(2 * d, a.n_heads * a.head_dim, bias=cfg.qkv_bias)
        a.k_proj = nn.Linear(2 * d, a.n_kv * a.head_dim, bias=cfg.qkv_bias)
        a.v_proj = nn.Linear(2 * d, a.n_kv * a.head_dim, bias=cfg.qkv_bias)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, embeds, hidden, cos, sin, mask, write_pos, kv, kv_len):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = residual + self.self_attn(x, cos, sin, mask, write_pos, kv, kv_len)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    def __init__(self, hc: Eagle3Config):
        super().__init__()
        c = hc.layer
        self.head_config = hc
        self.config = c  # what KV caches and the weight formats read
        self.fc = nn.Linear(3 * hc.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c, hc.norm_before_residual)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, hc.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(hc.draft_vocab_size, dtype=torch.long))
        self.register_buffer("inv_freq", rope_inv_freq(c.rope, c.head_dim).to(torch.get_default_device()),
                             persistent=False)
        self.aux_layers: tuple[int, ...] = hc.aux_layers or ()
        self._identity_vocab = False  # draft vocabulary == the target's, in order (set by attach())
        object.__setattr__(self, "embed_tokens", None)  # the target's embedding, not a submodule (attach())

    def attach(self, target) -> Eagle3Head:
        """Read `target`'s hidden states and share its embedding; checks the sizes agree."""
        hc, tc = self.head_config, target.config
        if tc.hidden_size != hc.target_hidden_size:
            raise QuickdraftError(f"this EAGLE-3 head reads hidden states of size {hc.target_hidden_size}; "
                                  f"the target's are {tc.hidden_size}: it was trained for another model")
        if tc.vocab_size != hc.layer.vocab_size:
            raise QuickdraftError(f"this EAGLE-3 head maps into a vocabulary of {hc.layer.vocab_size} tokens; "
                                  f"the target has {tc.vocab_size}: it was trained for another model")
        layers = hc.aux_layers or default_aux_layers(tc.num_hidden_layers)
        if max(layers) > tc.num_hidden_layers:
            raise QuickdraftError(f"this EAGLE-3 head reads target layers {list(layers)}; "
                                  f"the target has {tc.num_hidden_layers}")
        self.aux_layers = tuple(layers)
        object.__setattr__(self, "embed_tokens", target.model.embed_tokens)
        self._identity_vocab = hc.draft_vocab_size == tc.vocab_size and not bool(self.d2t.any())
        self.register_buffer("draft_to_target", torch.arange(hc.draft_vocab_size, device=self.d2t.device) + self.d2t,
                             persistent=False)
        return self

    @property
    def device(self) -> torch.device:
        return self.d2t.device

    @property
    def dtype(self) -> torch.dtype:
        return self.midlayer.input_layernorm.weight.dtype

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: CacheView | None = None, kv_len: int | None = None, slots: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None, project: bool = True):
        """input_ids (B, T) target token ids; hidden (B, T, 3 x target hidden) target states when
        `project`, else (B, T, hidden) the head's own previous outputs. Returns the draft-vocabulary
        logits (B, T, draft V) and the output hidden (B, T, hidden) the next step feeds back.
        positions, cache, kv_len, slots, attn_mask: as Transformer.forward (a one-layer cache)."""
        cos, sin, mask, write_pos, kv_len = attention_inputs(self.inv_freq, self.dtype, positions, cache, kv_len,
                                                             slots, attn_mask, self.config.sliding_window)
        if project:
            hidden = self.fc(hidden.to(self.dtype))
        kv = None if cache is None else (cache.k[0], cache.v[0])
        out = self.midlayer(self.embed_tokens(input_ids).to(self.dtype), hidden, cos, sin, mask, write_pos, kv, kv_len)
        return self.lm_head(self.norm(out)), out

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary token ids as the target's."""
        return draft_ids if self._identity_vocab else self.draft_to_target[draft_ids]

    def to_target(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Draft-vocabulary logits (..., draft V) as target-vocabulary logits (..., V): -inf for
        every token outside the draft vocabulary (probability 0 after any processing)."""
        if self._identity_vocab:
            return logits
        full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_to_target, logits)


_RENAMES = (("layers.0.", "midlayer."), ("model.layers.0.", "midlayer."),
            ("model.fc.", "fc."), ("model.norm.", "norm."))


def _head_name(name: str) -> str:
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _read_weights(file: Path, quantised: compressed.Int8Scheme | None = None):
    """(name, tensor) pairs of a .safetensors file (int8 weights dequantised to float32), or of a
    PyTorch .bin (EAGLE's own heads ship as pytorch_model.bin), read with weights_only: tensors,
    never code."""
    if file.suffix == ".safetensors":
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            f = compressed.open_weights(handle, file, quantised)
            for name in f.keys():
                yield name, f.get_tensor(name)
        return
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a damaged or non-tensor pickle: one line
        raise QuickdraftError(f"cannot read {file}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    if not isinstance(state, dict):
        raise QuickdraftError(f"{file}: not a state dict")
    yield from state.items()


def load_eagle3(path: str | Path, target, dtype: torch.dtype | None = None) -> Eagle3Head:
    """An EAGLE-3 head folder, on the target's device (and dtype unless given), attached to it."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise QuickdraftError(f"not an EAGLE-3 head folder (no config.json): {path}")
    hc = Eagle3Config.from_file(path / "config.json")
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise QuickdraftError(f"{path}: no weights (model.safetensors or pytorch_model.bin)")
    with torch.device("meta"):
        head = Eagle3Head(hc)
    expected = dict(head.named_parameters())
    expected["d2t"] = head.d2t
    state: dict[str, torch.Tensor] = {}
    quantised = compressed.scheme(json.loads((path / "config.json").read_text()))
    for file in files:
        for name, tensor in _read_weights(file, quantised):
            key = _head_name(name)
            if key in ("embed_tokens.weight", "t2d") or key.endswith("rotary_emb.inv_freq") \
                    or key.startswith(("verifier_", "model.embed_tokens")):
                continue  # the target's embedding is used; t2d is implied by d2t
            if key not in expected:
                raise QuickdraftError(f"{path}: unexpected tensor {name} for an EAGLE-3 head")
            state[key] = tensor
    missing = sorted(set(expected) - set(state) - {"d2t"})
    if missing:
        raise QuickdraftError(f"{path}: missing tensors: {', '.join(missing[:5])}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise QuickdraftError(f"{path}: tensor {name} has shape {tuple(t.shape)}, "
                                  f"config implies {tuple(expected[name].shape)}")
    device = target.device
    dtype = dtype or target.dtype
    if "d2t" not in state and hc.draft_vocab_size != hc.layer.vocab_size:
        raise QuickdraftError(f"{path}: missing tensors: d2t (a draft vocabulary of {hc.draft_vocab_size} tokens "
                              f"needs its map to the target's {hc.layer.vocab_size})")
    d2t = state.pop("d2t", torch.zeros(hc.draft_vocab_size, dtype=torch.long)).to(device=device, dtype=torch.long)
    ids = torch.arange(hc.draft_vocab_size, device=device) + d2t
    if ids.min() < 0 or ids.max() >= hc.layer.vocab_size or ids.unique().numel() != ids.numel():
        raise QuickdraftError(f"{path}: d2t does not map the draft vocabulary onto distinct target tokens")
    head.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()} | {"d2t": d2t},
                         strict=False, assign=True)
    head.inv_freq = rope_inv_freq(hc.layer.rope, hc.layer.head_dim).to(device)
    head.checkpoint_path = path
    return head.attach(target).eval().requires_grad_(False)


def is_eagle3_head(path: str | Path) -> bool:
    """Whether `path` is a folder whose config.json describes an EAGLE-3 head (either layout)."""
    config = Path(path) / "config.json"
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and (cfg.get("speculators_model_type") == "eagle3"
                                      or bool(set(cfg.get("architectures") or ()) & set(EAGLE3_ARCHITECTURES)))


def save_eagle3(head: Eagle3Head, path: str | Path, target_config: dict | None = None,
                dtype: torch.dtype | None = None) -> Path:
    """Write `head` (an unprepared one: plain linear layers) as an EAGLE-3 folder in EAGLE's own
    layout (config.json + model.safetensors), its floating tensors in `dtype` (default: as
    they are)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hc, c = head.head_config, head.head_config.layer
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings, "rope_theta": c.rope.theta,
        "hidden_act": "silu", "tie_word_embeddings": False, "draft_vocab_size": hc.draft_vocab_size,
        "target_hidden_size": hc.target_hidden_size, "norm_before_residual": hc.norm_before_residual,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(head.aux_layers or hc.aux_layers or ()) or None,
                         "use_aux_hidden_state": True},
        "torch_dtype": str(dtype or head.dtype).removeprefix("torch."),
    }
    if target_config:
        config["quickdraft_target"] = target_config
    (path / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.detach().to(dtype=dtype if dtype and v.is_floating_point() else v.dtype).contiguous().cpu()
             for k, v in head.state_dict().items()}
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[torch.arange(hc.draft_vocab_size) + state["d2t"]] = True
    save_file(state | {"t2d": t2d}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def new_head(target, draft_vocab: torch.Tensor | None = None, intermediate_size: int | None = None,
             norm_before_residual: bool = False) -> Eagle3Head:
    """A freshly initialised head for `target` (to train): the target's attention shape,
    `draft_vocab` (sorted distinct target ids; None = the whole vocabulary) and its default
    low / middle / high layers; float32 on the target's device, attached."""
    tc = target.config
    vocab = tc.vocab_size
    ids = torch.arange(vocab) if draft_vocab is None else torch.as_tensor(draft_vocab, dtype=torch.long).sort().values
    layer = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=tc.hidden_size,
                        intermediate_size=intermediate_size or tc.intermediate_size, num_hidden_layers=1,
                        num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
                        head_dim=tc.head_dim, rms_norm_eps=tc.rms_norm_eps,
                        max_position_embeddings=tc.max_position_embeddings, rope=tc.rope)
    hc = Eagle3Config(layer=layer, draft_vocab_size=int(ids.numel()), target_hidden_size=tc.hidden_size,
                      aux_layers=default_aux_layers(tc.num_hidden_layers), norm_before_residual=norm_before_residual,
                      layout="eagle3")
    head = Eagle3Head(hc)
    head.d2t.copy_(ids - torch.arange(ids.numel()))
    return head.to(target.device).attach(target)
