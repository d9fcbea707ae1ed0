"""One decoder for the Llama family: Llama 2/3/3.x, Mistral, Qwen2/2.5, Qwen3.

The differences between these models are configuration, not code: biases on the
projections (Qwen2, Llama `attention_bias` / `mlp_bias`), RMSNorm on q and k per head
(Qwen3), the rotary frequency schedule (llama3 scaling), a sliding attention window
(Mistral), grouped-query attention, tied embeddings. Parameter names follow the
Hugging Face checkpoints so a state dict loads without renaming.

forward(input_ids, positions, cache, logits_at) is the only entry point:
- no cache: ordinary causal attention over the given tokens;
- with a cache view: each token's k/v is written at its position, then queries attend
  to cached keys at positions <= their own. Position -1 marks a padding token.
- token trees (quickdraft.tree): the caller gives each token a cache slot apart from its
  position and the attention mask over slots, since siblings share a position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..cache import CacheView, to_device
from ..config import ModelConfig, RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            if (x.device.type == "cpu" and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
                    and kernels.available()):  # one call (PyTorch's takes several ops), each row its own bits
                return kernels.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one op: weight * normalised x
        # Normalise in float32 as the reference does; bf16 variance is too coarse.
        dtype = x.dtype
        x = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Rotary inverse frequencies (head_dim / 2,), float32, with the configured scaling; computed
    on the CPU whatever the default device (on meta these ops import PyTorch's Python references:
    ~1 s of start-up)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, and the
        # band in between interpolated smoothly between the two.
        old_len = rope.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        slow = inv_freq / rope.factor
        mix = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - mix) * slow + mix * inv_freq
        long_wave = wavelen > old_len / rope.low_freq_factor
        short_wave = wavelen < old_len / rope.high_freq_factor
        return torch.where(long_wave, slow, torch.where(short_wave, inv_freq, blended))
    return inv_freq


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding: x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1).
    `sin` comes with the sign of the first half folded in ((-sin, sin)), so rotate_half(x) * sin is
    x with its halves swapped times it: three ops instead of six, the same products."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_proj = None  # q, k and v in one matmul once fused for inference (model.quant.prepare)

    def fuse_projections(self, make) -> None:
        self.qkv_proj = make([self.q_proj, self.k_proj, self.v_proj])
        self.q_proj = self.k_proj = self.v_proj = None

    def forward(self, x, cos, sin, mask, write_pos, kv: tuple[torch.Tensor, torch.Tensor] | None, kv_len: int):
        """kv: this layer's cache tensors (k, v), each (rows, H_kv, slots, D), or None."""
        B, T, _ = x.shape
        q, k, v = self._project(x, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)
        if kv is not None:
            ck, cv = kv
            # (B, T, H_kv, D) into (B, H_kv, S, D) at (row, :, position), in the cache's dtype (kv_cache_dtype)
            ck[write_pos] = k.transpose(1, 2).to(ck.dtype)
            cv[write_pos] = v.transpose(1, 2).to(cv.dtype)
            # the view may hold more rows than the batch (static-shape steps pass the whole cache)
            k, v = ck[:B, :, :kv_len], cv[:B, :, :kv_len]
        out = attention(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def forward_packed(self, x, cos, sin, layer: int, groups: list[_Group]):
        """Forward_packed's layer: x (1, N, d) holds every block's tokens, one after the other; the
        projections run on the N tokens together, attention per block over its own rows of its cache."""
        q, k, v = self._project(x, cos, sin)  # (1, N, heads, D)
        outs = []
        for g in groups:
            ck, cv = g.cache.k[layer], g.cache.v[layer]
            ck[g.write_pos] = k[0, g.start:g.stop].to(ck.dtype)  # (n, H_kv, D) at (row, :, slot) each
            cv[g.write_pos] = v[0, g.start:g.stop].to(cv.dtype)
            qg = q[0, g.start:g.stop].unflatten(0, (g.rows, -1)).transpose(1, 2)  # (rows, H, T, D)
            kg, vg = ck[g.row:g.row + g.rows, :, :g.kv_len], cv[g.row:g.row + g.rows, :, :g.kv_len]
            outs.append(attention(qg, kg, vg, g.mask).transpose(1, 2).reshape(g.stop - g.start, -1))
        return self.o_proj(torch.cat(outs)[None])

    def _project(self, x, cos, sin):
        """q, k, v (B, T, heads, D) of x (B, T, d), q and k rotated."""
        B, T, _ = x.shape
        H, H_kv, D = self.n_heads, self.n_kv, self.head_dim
        if self.qkv_proj is not None and self.q_norm is None:
            # fused: one rotation over the q and k heads together
            qkv = self.qkv_proj(x).view(B, T, H + 2 * H_kv, D)
            qk = rotate(qkv[:, :, :H + H_kv], cos, sin)
            q, k, v = qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + H_kv:]
        else:
            if self.qkv_proj is not None:
                q, k, v = self.qkv_proj(x).split(self.qkv_proj.splits, dim=-1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k, v = q.view(B, T, H, D), k.view(B, T, H_kv, D), v.view(B, T, H_kv, D)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        return q, k, v


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) where mask) v, grouped-query heads: q (B, H, T, D), k / v (B, H_kv,
    L, D), mask bool (B, 1, T, L). Inference on CPU in float32 (bfloat16: widened) runs quickdraft's kernel
    (kernels.attend: one read of each kv head's cache for several query rows, the same bits for a
    token whatever the rows beside it), all query rows in one call: a prompt's prefill padded
    beside longer prompts, a token tree of any size (in an exported step too), a verify step of
    any k give each row the bits a decode step gives it; elsewhere, and under autograd, PyTorch's
    attention (whose bits for a row depend on the query and key counts). k and v may be a 16-bit
    cache's (float16, bfloat16: kv_cache_dtype) whatever q's dtype: the kernel widens them as it
    reads them (exact), elsewhere they are widened to q's dtype first."""
    if (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and mask.dtype == torch.bool
            and k.dtype in _KERNEL_KV and v.dtype == k.dtype
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
            and q.shape[-1] % 16 == 0 and kernels.available()):
        dtype = q.dtype
        if dtype != torch.float32:  # bfloat16 queries widened (exact): float32 sums, every row its own bits
            q = q.float()
        return kernels.attend(q, k, v, mask, q.shape[-1] ** -0.5).to(dtype)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


_KERNEL_KV = (torch.float32, torch.float16, torch.bfloat16)  # the caches kernels.attend reads as they are


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(d, f, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=cfg.mlp_bias)
        self.gate_up_proj = None  # gate and up in one matmul once fused for inference

    def fuse_projections(self, make) -> None:
        self.gate_up_proj = make([self.gate_proj, self.up_proj])
        self.gate_proj = self.up_proj = None

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, write_pos, kv, kv_len):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, write_pos, kv, kv_len)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Named `model` inside Transformer so parameter names match HF checkpoints."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.kv_cache_dtype: torch.dtype | None = None  # set by the engine; None: its dtype (cache.cache_dtype)
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.head_dim).to(torch.get_default_device()),
                             persistent=False)

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after building on the meta device)."""
        device = self.model.embed_tokens.weight.device
        self.inv_freq = rope_inv_freq(self.config.rope, self.config.head_dim).to(device)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: CacheView | None = None, logits_at: torch.Tensor | None = None,
                kv_len: int | None = None, slots: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, V), or (B, n, V) at the indices `logits_at` (B, n).

        positions (B, T): absolute positions, -1 for padding; default 0..T-1.
        cache: rows of a KVCache, one per batch row; kv_len (optional) bounds the keys read
        (max position + 1), saving a device sync when the caller already knows it.
        slots (B, T) and attn_mask (B, T, kv_len), with a cache only: where each token's k/v
        is written (-1 = nowhere) and which cache slots each query may read (token trees).
        """
        return self._run(input_ids, positions, cache, logits_at, kv_len, slots, attn_mask, None)[0]

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                       cache: CacheView | None = None, logits_at: torch.Tensor | None = None,
                       kv_len: int | None = None, slots: torch.Tensor | None = None,
                       attn_mask: torch.Tensor | None = None, *,
                       hidden_at: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward (same arguments) that also returns hidden states: (logits, hidden), hidden
        (B, T, len(hidden_at) * hidden_size) concatenating the residual stream entering each layer
        in `hidden_at` (index num_hidden_layers: leaving the last, before the final norm), at
        every position: what an EAGLE-3 head reads, from the same forward."""
        return self._run(input_ids, positions, cache, logits_at, kv_len, slots, attn_mask, tuple(hidden_at))

    def _run(self, input_ids, positions, cache, logits_at, kv_len, slots, attn_mask, hidden_at):
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        cos, sin, mask, write_pos, kv_len = attention_inputs(self.inv_freq, self.dtype, positions, cache, kv_len,
                                                             slots, attn_mask, self.config.sliding_window)
        x = self.model.embed_tokens(input_ids)
        captured = []
        for i, layer in enumerate(self.model.layers):
            if hidden_at is not None and i in hidden_at:
                captured.append((i, x))
            kv = None if cache is None else (cache.k[i], cache.v[i])
            x = layer(x, cos, sin, mask, write_pos, kv, kv_len)
        if hidden_at is not None:
            captured.append((len(self.model.layers), x))
            by_layer = dict(captured)
            hidden = torch.cat([by_layer[i] for i in hidden_at], dim=-1)
        if logits_at is not None:
            x = x.gather(1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
        logits = self.lm_head(self.model.norm(x))
        return logits, (hidden if hidden_at is not None else None)

    def forward_packed(self, blocks: list[Block], cache: CacheView | None = None,
                       hidden_at: tuple[int, ...] | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Several forwards over the cache in one: each block is what `forward` would be given
        (its tokens on its own rows of `cache`, or of the block's own `cache` view), and every
        block's tokens go through the linear layers together, as one (N, hidden) matrix of valid
        tokens (no padding: a 1-token row beside a 64-token chunk computes 65 positions, not 128),
        so the weights are read once for all; attention runs per block, on the block's rows of its
        cache. lm_head runs only where a block wants logits. Returns per block (logits (b, n, V) at
        its `logits_at`, or (b, T, V); hidden (b, T, ...) as forward_hidden gives them, or None
        without `hidden_at`). With row-invariant linear layers (quant.row_invariant) and
        quickdraft's attention kernel, each block gets the bits its own forward gives it, whatever
        blocks share the call (an AOT package of it too: aot's packed step)."""
        window = self.config.sliding_window
        cos, sin, groups, picks, start = [], [], [], [], 0
        for blk in blocks:
            b, T = blk.input_ids.shape
            view = blk.cache if blk.cache is not None else cache
            c, s, mask, write_pos, kv_len = attention_inputs(self.inv_freq, self.dtype, blk.positions, view,
                                                             blk.kv_len, blk.slots, blk.attn_mask, window)
            cos.append(c.flatten(0, 1))
            sin.append(s.flatten(0, 1))
            write_pos = ((write_pos[0] + blk.row).flatten(), slice(None), write_pos[2].flatten())
            groups.append(_Group(start, start + b * T, blk.row, b, mask, kv_len, view, write_pos))
            at = torch.arange(T, device=blk.input_ids.device).expand(b, T) if blk.logits_at is None else blk.logits_at
            picks.append((start + T * torch.arange(b, device=at.device)[:, None] + at).flatten())
            start += b * T
        cos, sin = torch.cat(cos)[None], torch.cat(sin)[None]  # (1, N, 1, D)
        x = self.model.embed_tokens(torch.cat([blk.input_ids.flatten() for blk in blocks])[None])  # (1, N, d)
        captured = []
        for i, layer in enumerate(self.model.layers):  # DecoderLayer.forward, attention per block
            if hidden_at is not None and i in hidden_at:
                captured.append((i, x))
            x = x + layer.self_attn.forward_packed(layer.input_layernorm(x), cos, sin, i, groups)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        hidden = None
        if hidden_at is not None:
            captured.append((len(self.model.layers), x))
            by_layer = dict(captured)
            hidden = torch.cat([by_layer[i] for i in hidden_at], dim=-1)[0]  # (N, ...)
        sizes = [p.shape[0] for p in picks]
        logits = self.lm_head(self.model.norm(x[0, torch.cat(picks)])).split(sizes)  # (n_i, V) per block
        out = []
        for blk, g, lg in zip(blocks, groups, logits):
            h = None if hidden is None else hidden[g.start:g.stop].unflatten(0, (g.rows, -1))
            out.append((lg.unflatten(0, (g.rows, -1)), h))
        return out


@dataclass(frozen=True)
class Block:
    """One forward's worth of forward_packed: input_ids / positions (b, T) on cache rows row ..
    row + b - 1 (of forward_packed's view, or `cache`), and forward's kv_len, slots, attn_mask and
    logits_at ((b, n); None: every position)."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    row: int = 0
    kv_len: int | None = None
    slots: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None
    logits_at: torch.Tensor | None = None
    cache: CacheView | None = None  # the block's own cache view (row counted in it); None: forward_packed's


@dataclass(frozen=True)
class _Group:
    """A block's tokens [start, stop) in a packed forward, its cache rows and attention inputs."""
    start: int
    stop: int
    row: int
    rows: int
    mask: torch.Tensor  # (rows, 1, T, kv_len)
    kv_len: int
    cache: CacheView  # the view its rows are in
    write_pos: tuple  # where its tokens' k / v go in that view: (rows, :, slots), flat


def attention_inputs(inv_freq: torch.Tensor, dtype: torch.dtype, positions: torch.Tensor, cache: CacheView | None,
                     kv_len: int | None, slots: torch.Tensor | None, attn_mask: torch.Tensor | None,
                     window: int | None = None):
    """What every layer of a forward shares: rotary cos / sin (B, T, 1, D), the attention mask
    (B, 1, T, S), where the new keys are written and how many keys are read (see forward)."""
    B, T = positions.shape
    device = positions.device
    pos = positions.clamp(min=0)  # padding gets a harmless position
    # RoPE angles in float32, cast to the activation dtype like the reference.
    angles = pos[..., None].float() * inv_freq  # (B, T, D/2)
    cos, sin = angles.cos(), angles.sin()
    cos = torch.cat((cos, cos), dim=-1)[:, :, None, :].to(dtype)  # (B, T, 1, D)
    sin = torch.cat((-sin, sin), dim=-1)[:, :, None, :].to(dtype)  # the sign of rotate_half folded in
    if cache is not None:
        if slots is None:
            slots = positions
        if kv_len is None:
            kv_len = int(slots.max()) + 1
        key_pos = torch.arange(kv_len, device=device)  # a key's slot (its position outside trees)
        mask = key_pos <= pos[..., None] if attn_mask is None else attn_mask  # (B, T, S)
        rows = torch.arange(B, device=device)[:, None].expand(B, T)
        write_pos = (rows, slice(None), torch.where(slots >= 0, slots, cache.trash))
    else:
        kv_len = T
        key_pos = positions[:, None, :]  # (B, 1, T) keys are the tokens themselves
        mask = (key_pos <= pos[..., None]) & (key_pos >= 0)
        # a padding query must still see one key, or softmax over nothing gives NaN
        mask = mask | (positions[..., None] < 0)
        write_pos = None
    # In a tree a node's slot is >= its position, so ancestors are only dropped by the
    # window when the tree is deeper than the window itself.
    if window is not None:
        mask = mask & (key_pos > pos[..., None] - window)
    return cos, sin, mask[:, None], write_pos, kv_len  # the mask is shared by all heads and layers


def pad_chunks(chunks: list[list[int]], starts: list[int], device: torch.device):
    """Runs of tokens, row b's from position starts[b], as one right-padded batch: input_ids and
    positions (B, T) (-1: padding), each row's last index (B, 1) and the key length (on `device`)."""
    B, T = len(chunks), max(len(c) for c in chunks)
    ids = torch.zeros(B, T, dtype=torch.long)
    positions = torch.full((B, T), -1, dtype=torch.long)
    for b, (chunk, start) in enumerate(zip(chunks, starts)):
        ids[b, :len(chunk)] = torch.tensor(chunk, dtype=torch.long)
        positions[b, :len(chunk)] = torch.arange(start, start + len(chunk))
    last = torch.tensor([max(len(c) - 1, 0) for c in chunks], dtype=torch.long)[:, None]
    kv_len = max(s + len(c) for s, c in zip(starts, chunks))
    return to_device(ids, device), to_device(positions, device), to_device(last, device), kv_len


def forward_chunks(model: Transformer, chunks: list[list[int]], starts: list[int],
                   cache: CacheView, step=None, hidden_at: tuple[int, ...] | None = None):
    """Feed each row its own run of tokens (ragged; right-padded here) starting at
    position starts[b], writing the cache; returns the logits after each row's last
    token, (B, V) (meaningless for an empty run, which feeds nothing). Used for prefill and
    for a draft catching up with accepted tokens.
    `step` (a compiled StepFunction) is used instead of the model when given. With
    `hidden_at`, (logits, hidden (B, T, ...)) at every fed position (Transformer.forward_hidden)."""
    ids, positions, last, kv_len = pad_chunks(chunks, starts, model.device)
    if hidden_at is not None:
        logits, hidden = model.forward_hidden(ids, positions, cache, logits_at=last, kv_len=kv_len, hidden_at=hidden_at)
        return logits[:, 0], hidden
    logits = (step or model)(ids, positions, cache, logits_at=last, kv_len=kv_len)
    return logits[:, 0]
