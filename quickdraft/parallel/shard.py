"""Megatron-style tensor-parallel shards of the target: which slice of each weight a rank holds,
read shard-wise from safetensors, and the modules that join the partial results.

Per decoder layer (N ranks, rank r):
- q/k/v and gate/up are column-parallel: rank r holds its heads' rows of q (H/N heads), of k and v
  (KV/N heads; with N > KV each KV head is held by the N/KV ranks whose q heads read it), and
  F/N rows of gate and up. Attention and the SiLU gate run on local heads / columns only.
- o and down are row-parallel: rank r holds the matching input columns, so each produces a
  partial sum of the layer's output; one all-reduce each joins them (`RowParallel`). A bias on
  o / down is added once (rank 0 holds it; the others hold zeros).
- norms and the embedding are replicated (an embedding row lookup is cheap and needs no
  communication).
- lm_head: "rank0" (only rank 0 holds and applies it: the verifier runs there and the other
  ranks never need logits) or "vocab" (each rank V/N rows, logits gathered to rank 0).
Each rank's KV cache holds only its own KV heads (the local config's num_key_value_heads).

A GGUF target (its metadata folder) is read the same way through `gguf.GGUFWeights`, which
offers safetensors' get_slice: a row range is dequantised from its own blocks only, a column
range from each row's blocks that it covers when it falls on block boundaries.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from ..config import ModelConfig
from ..errors import QuickdraftError
from ..model import compressed
from ..model.gguf import GGUFWeights, gguf_source, is_gguf_file, mark_wide
from ..model.loader import assemble, resolve_dtype, weight_files
from ..model.transformer import Transformer

LM_HEAD_MODES = ("rank0", "vocab")

_LAYER = re.compile(r"model\.layers\.\d+\.")


def check_tensor_parallel(cfg: ModelConfig, world: int) -> None:
    """A clear error when the target's shapes do not split over `world` ranks."""
    H, KV, F = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    if world < 1:
        raise QuickdraftError(f"tensor_parallel_size must be >= 1, got {world}")
    if H % world:
        raise QuickdraftError(f"tensor_parallel_size {world} does not divide the target's {H} attention heads")
    if KV % world and world % KV:
        raise QuickdraftError(f"tensor_parallel_size {world} and the target's {KV} key/value heads: one must "
                              "divide the other (KV heads are split, or replicated when there are fewer than ranks)")
    if F % world:
        raise QuickdraftError(f"tensor_parallel_size {world} does not divide the target's intermediate_size {F}")


@dataclass(frozen=True)
class Slice:
    dim: int  # 0: rows (output features), 1: columns (input features)
    start: int
    stop: int
    zero: bool = False  # a row-parallel bias on ranks > 0: added once, by rank 0


@dataclass(frozen=True)
class ShardPlan:
    cfg: ModelConfig  # the whole target's
    rank: int
    world: int
    lm_head: str = "rank0"

    def __post_init__(self) -> None:
        check_tensor_parallel(self.cfg, self.world)
        if self.lm_head not in LM_HEAD_MODES:
            raise QuickdraftError(f"lm_head sharding must be one of {', '.join(LM_HEAD_MODES)}, got {self.lm_head!r}")

    @property
    def heads(self) -> int:
        return self.cfg.num_attention_heads // self.world

    @property
    def kv_heads(self) -> int:
        return max(1, self.cfg.num_key_value_heads // self.world)

    @property
    def kv_start(self) -> int:
        KV = self.cfg.num_key_value_heads
        if self.world <= KV:
            return self.rank * self.kv_heads
        return self.rank // (self.world // KV)  # replicated: the KV head this rank's q heads read

    @property
    def ffn(self) -> int:
        return self.cfg.intermediate_size // self.world

    @property
    def vocab_rows(self) -> int:
        """lm_head rows per rank in "vocab" mode (the last rank's are zero-padded)."""
        return -(-self.cfg.vocab_size // self.world)

    def local_config(self) -> ModelConfig:
        """The config a rank's modules (and its KV cache) are built from."""
        return dataclasses.replace(self.cfg, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                                   intermediate_size=self.ffn)

    def slice_for(self, name: str) -> Slice | None:
        """The part of checkpoint tensor `name` this rank holds; None: all of it."""
        D, r = self.cfg.head_dim, self.rank
        leaf = _LAYER.sub("", name)
        if leaf in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
            return Slice(0, r * self.heads * D, (r + 1) * self.heads * D)
        if leaf.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
            return Slice(0, self.kv_start * D, (self.kv_start + self.kv_heads) * D)
        if leaf.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
            return Slice(0, r * self.ffn, (r + 1) * self.ffn)
        if leaf == "self_attn.o_proj.weight":
            return Slice(1, r * self.heads * D, (r + 1) * self.heads * D)
        if leaf == "mlp.down_proj.weight":
            return Slice(1, r * self.ffn, (r + 1) * self.ffn)
        if leaf in ("self_attn.o_proj.bias", "mlp.down_proj.bias"):
            return None if r == 0 else Slice(0, 0, self.cfg.hidden_size, zero=True)
        return None


def _read(f, name: str, s: Slice | None) -> torch.Tensor:
    """Only this rank's part of a tensor is read from the file."""
    t = f.get_slice(name)[_key(s)]
    return torch.zeros_like(t) if s is not None and s.zero else t


def _open(file: Path, cfg: ModelConfig):
    """safetensors' `safe_open`, or for a GGUF its `GGUFWeights` (the same keys / get_slice / get_tensor)."""
    if file.suffix == ".safetensors" or not is_gguf_file(file):
        return safe_open(str(file), framework="pt", device="cpu")
    return GGUFWeights(file, cfg)


def load_shard(path: Path, plan: ShardPlan, dtype: str | torch.dtype | None, device: torch.device,
               comm: Comm, quantization: str | None = None) -> Transformer:
    """This rank's shard of the checkpoint at `path` (a safetensors folder, or a GGUF's metadata
    folder: then the weights come from the GGUF), with the all-reduce / gather modules in place.
    Each tensor is read as a slice: no rank reads the others' weights (a GGUF's row-parallel
    columns that do not fall on its quant blocks excepted: see `gguf.read_part`). With
    quantization="int4", a GGUF's 4-bit blocks are kept for `quant.prepare`, sliced alike."""
    cfg, local = plan.cfg, plan.local_config()
    torch_dtype = resolve_dtype(dtype, cfg, device)
    state: dict[str, torch.Tensor] = {}
    head_weight = None  # the (untied) lm_head rows this rank holds
    vocab = slice(plan.rank * plan.vocab_rows, (plan.rank + 1) * plan.vocab_rows)
    source = gguf_source(path)
    int4: dict[str, tuple[torch.Tensor, ...]] | None = {} if source is not None and quantization == "int4" else None
    head_groups = None
    quantised = None if source is not None else compressed.scheme(json.loads((path / "config.json").read_text()))
    for file in [source] if source is not None else weight_files(path):
        try:
            with _open(file, cfg) as handle:
                f = compressed.open_weights(handle, file, quantised)
                for name in f.keys():
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    if name == "lm_head.weight":
                        if cfg.tie_word_embeddings:
                            continue
                        if plan.lm_head == "vocab":
                            head_weight = f.get_slice(name)[vocab].to(device=device, dtype=torch_dtype)
                            head_groups = int4 is not None and f.get_slice(name).int4(vocab)
                        elif plan.rank == 0:
                            head_weight = f.get_tensor(name).to(device=device, dtype=torch_dtype)
                            head_groups = int4 is not None and f.get_slice(name).int4()
                        state[name] = torch.empty(cfg.vocab_size, cfg.hidden_size, device="meta")
                        continue
                    s = plan.slice_for(name)
                    state[name] = _read(f, name, s).to(device=device, dtype=torch_dtype)
                    if int4 is not None and state[name].dim() == 2:
                        groups = f.get_slice(name).int4(_key(s))
                        if groups is not None:
                            int4[name] = tuple(x.to(device) for x in groups)
        except (OSError, RuntimeError, ValueError) as exc:
            if isinstance(exc, QuickdraftError):
                raise
            raise QuickdraftError(f"cannot read weights {file}: {exc}") from None
    model = assemble(local, state, path)
    model.config = cfg  # what the engine and proposers read (vocabulary, context); layers use local shapes
    model.tp_plan = plan
    for name, groups in (int4 or {}).items():
        model.get_parameter(name).gguf_int4 = groups
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, comm)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, comm)
    embed = model.model.embed_tokens.weight
    if plan.lm_head == "vocab":
        rows = head_weight if head_weight is not None else embed[vocab]
        if head_weight is None and int4 is not None and "model.embed_tokens.weight" in int4:
            head_groups = tuple(x[vocab] for x in int4["model.embed_tokens.weight"])
        if rows.shape[0] < plan.vocab_rows:  # the last rank's short share, padded to gather equal parts
            pad = plan.vocab_rows - rows.shape[0]
            rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
            if head_groups:  # padded rows of zeros: q = 8 and every scale, zero, code and factor 0
                q, *rest = head_groups
                head_groups = (torch.cat([q, q.new_full((pad, q.shape[1]), 8)]),
                               *(torch.cat([x, x.new_zeros(pad, x.shape[1])]) for x in rest))
        model.lm_head = VocabParallelHead(rows, cfg.vocab_size, comm)
        if head_groups:
            model.lm_head.linear.weight.gguf_int4 = head_groups
    elif plan.rank == 0:
        if head_weight is not None:
            model.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device="meta")
            model.lm_head.weight = nn.Parameter(head_weight, requires_grad=False)
            if head_groups:
                model.lm_head.weight.gguf_int4 = head_groups
    else:
        model.lm_head = NoLogits()
    if int4 is not None:
        mark_wide(model)
    return model


def _key(s: Slice | None):
    """The index `_read` takes for slice `s`."""
    if s is None:
        return slice(None)
    return slice(s.start, s.stop) if s.dim == 0 else (slice(None), slice(s.start, s.stop))


class Comm:
    """The collectives a shard's forward runs, over the compute group."""

    def __init__(self, group, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0: the ranks' tensors concatenated on the last dim; other ranks: their own."""
        parts = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(t.contiguous(), parts, dst=dist.get_global_rank(self.group, 0) if self.group else 0,
                    group=self.group)
        return torch.cat(parts, -1) if self.rank == 0 else t


class RowParallel(nn.Module):
    """A row-parallel projection (o_proj, down_proj): this rank's partial sum, all-reduced."""

    def __init__(self, linear: nn.Module, comm: Comm):
        super().__init__()
        self.linear = linear
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.linear(x))


class VocabParallelHead(nn.Module):
    """lm_head split by vocabulary rows; rank 0 gets the whole (…, V) logits."""

    def __init__(self, rows: torch.Tensor, vocab_size: int, comm: Comm):
        super().__init__()
        self.linear = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
        self.linear.weight = nn.Parameter(rows, requires_grad=False)
        self.vocab_size = vocab_size
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.comm.gather_last(self.linear(x))
        return logits[..., : self.vocab_size]


class NoLogits(nn.Module):
    """Ranks > 0 with lm_head on rank 0: nothing to compute (their logits would be unused)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], 0)
