"""Rank 0 drives, the other ranks follow: one scheduler, one verifier, N shards of the target.

The engine on rank 0 sees `TensorParallelTarget`, a drop-in for the target Transformer. Each
call (a forward, a KV-cache allocation, a row move, a tree compaction) is first sent to the
other ranks (`Channel`: a small header on the control group, the step's integer tensors
broadcast on the compute group), then run on rank 0's own shard; every rank runs the same
shard forward, joined by the all-reduces inside it. Only rank 0 gets logits, so the proposer,
the verifier and the scheduler run there once: nothing the other ranks hold depends on a
decision they would have to make identically.

A failure in a step (a rank died, a collective timed out) leaves the group unusable: rank 0
raises RankFailure for that step and for every later call, never waiting forever.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import traceback
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..cache import KVCache
from ..config import ModelConfig
from ..errors import QuickdraftError
from ..model.gguf import gguf_source
from ..model.quant import prepare
from .group import (DEFAULT_TIMEOUT_S, RankFailure, TPGroup, check_all, init_spawned, init_torchrun, send_json,
                    start_spawned, under_torchrun, watch_parent)
from .shard import Comm, ShardPlan, check_tensor_parallel, load_shard

log = logging.getLogger("quickdraft.parallel")


@dataclass(frozen=True)
class LoadSpec:
    """What every rank needs to load its shard (sent to spawned workers)."""
    path: str
    world: int
    dtype: str | torch.dtype | None
    device: str
    quantization: str | None
    lm_head: str
    timeout_s: float
    threads: int  # CPU: intra-op threads per rank (the ranks share the cores)
    compile: bool = False  # each rank runs its shard's forward as a compiled step (quickdraft.compile)


class Channel:
    """Rank 0 -> the other ranks: (op, meta) on the control group, tensors on the compute group
    (integers packed into one int64 tensor, masks into one uint8 tensor: two broadcasts at most)."""

    def __init__(self, group: TPGroup):
        self.group = group

    def send(self, op: str, meta: dict, tensors: tuple[torch.Tensor, ...] = ()) -> None:
        specs = [(tuple(t.shape), t.dtype == torch.bool) for t in tensors]
        send_json(self.group, [op, meta, specs])  # JSON, not a pickle: a rank runs no code it is sent
        ints = [t.reshape(-1).long() for t in tensors if t.dtype != torch.bool]
        masks = [t.reshape(-1).to(torch.uint8) for t in tensors if t.dtype == torch.bool]
        for packed in (ints, masks):
            if packed:
                dist.broadcast(torch.cat(packed).to(self.group.device), src=0)

    def recv(self) -> tuple[str, dict, list[torch.Tensor]]:
        op, meta, specs = send_json(self.group)
        device = self.group.device
        out: list[torch.Tensor | None] = [None] * len(specs)
        for is_mask, dtype in ((False, torch.long), (True, torch.uint8)):
            idx = [i for i, (_, m) in enumerate(specs) if m == is_mask]
            if not idx:
                continue
            sizes = [int(torch.Size(specs[i][0]).numel()) for i in idx]
            packed = torch.empty(sum(sizes), dtype=dtype, device=device)
            dist.broadcast(packed, src=0)
            for i, part in zip(idx, packed.split(sizes)):
                t = part.view(specs[i][0])
                out[i] = t.bool() if is_mask else t
        return op, meta, out


_FORWARD_TENSORS = ("input_ids", "positions", "logits_at", "slots", "attn_mask")


class TensorParallelTarget(nn.Module):
    """Rank 0's target: its own shard, and the channel that makes the other ranks follow.
    Reads of anything else (config, device, dtype, model, lm_head) go to the shard."""

    def __init__(self, shard: nn.Module, group: TPGroup, step=None):
        super().__init__()
        self.shard = shard
        self.group = group
        self.plan: ShardPlan = shard.tp_plan
        self.channel = Channel(group)
        self.step = step or shard  # per rank: the shard's forward, or its compiled step
        self.broken: str | None = None
        self._next_cache = 0
        self._freed: list[int] = []  # caches rank 0 dropped; the workers drop theirs with the next command
        self.closed = False
        self.users = 1  # LLMs sharing this target (one group per process: they share it)

    @property
    def split_head(self) -> bool:
        """Whether the lm_head is split over the ranks ("vocab"): then only a forward gives logits
        (the engine cannot apply the head to hidden states itself: prompt logprobs)."""
        return self.plan.lm_head == "vocab"

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "shard":
                raise
            return getattr(self._modules["shard"], name)

    # ---- every call goes to all ranks ------------------------------------------------

    def _call(self, op: str, meta: dict, tensors=(), local=None):
        if self.broken is not None:
            raise RankFailure(self.broken)
        if self.closed:
            raise QuickdraftError("the tensor-parallel group is closed")
        meta = dict(meta, freed=self._freed)
        self._freed = []
        try:
            self.channel.send(op, meta, tuple(tensors))
            return local() if local is not None else None
        except Exception as exc:  # a step half done on some ranks: the group cannot go on
            self.broken = (f"a tensor-parallel rank failed or timed out (limit {self.group.timeout_s:.0f} s) during "
                           f"{op}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            raise RankFailure(self.broken) from exc

    def forward(self, input_ids, positions=None, cache=None, logits_at=None, kv_len=None, slots=None,
                attn_mask=None):
        return self._forward(input_ids, positions, cache, logits_at, kv_len, slots, attn_mask, None)

    def forward_hidden(self, input_ids, positions=None, cache=None, logits_at=None, kv_len=None, slots=None,
                       attn_mask=None, *, hidden_at):
        return self._forward(input_ids, positions, cache, logits_at, kv_len, slots, attn_mask, tuple(hidden_at))

    def _forward(self, input_ids, positions, cache, logits_at, kv_len, slots, attn_mask, hidden_at):
        given = dict(input_ids=input_ids, positions=positions, logits_at=logits_at, slots=slots, attn_mask=attn_mask)
        names = [n for n in _FORWARD_TENSORS if given[n] is not None]
        rows = None
        if cache is not None:
            rows = (cache.parent.cache_id, cache.start, cache.start + cache.k[0].shape[0])
        meta = dict(rows=rows, kv_len=kv_len, hidden_at=hidden_at, names=names)
        return self._call("forward", meta, [given[n] for n in names],
                          lambda: _run_step(self.step, self.shard, input_ids, positions, cache, logits_at, kv_len,
                                            slots, attn_mask, hidden_at))

    def new_kv_cache(self, max_slots: int, capacity: int) -> ShardedKVCache:
        """KVCache.for_model's hook: a cache of this rank's KV heads, mirrored on every rank."""
        cid, self._next_cache = self._next_cache, self._next_cache + 1
        return self._call("new_cache", dict(cache=cid, slots=max_slots, capacity=capacity),
                          local=lambda: ShardedKVCache(self, cid, max_slots, capacity))

    def kv_token_bytes(self) -> int:
        """KVCache.token_bytes' hook: one position of one row of this rank's cache."""
        cfg = self.plan.cfg
        return 2 * cfg.num_hidden_layers * self.plan.kv_heads * cfg.head_dim * self.dtype.itemsize

    def release(self) -> None:
        """One user is done with the target; the last one closes the group."""
        self.users -= 1
        if self.users <= 0:
            self.close()

    def close(self) -> None:
        """Stop the other ranks and leave the group (rank 0; also at exit)."""
        if self.closed:
            return
        _OPEN.pop(self.key, None)
        if self.broken is None:
            try:
                self.channel.send("stop", {})
            except Exception:  # noqa: BLE001 - the workers are gone already
                self.broken = "closed after a failure"
        self.closed = True
        for p in self.group.workers or ():
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        if dist.is_initialized():  # after a failure too: else no later group can open in this process
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group's teardown: leaving is what matters
                pass


def _local_cache(plan: ShardPlan, dtype: torch.dtype, device: torch.device, slots: int, capacity: int):
    cfg = plan.cfg
    return cfg.num_hidden_layers, slots, plan.kv_heads, capacity, cfg.head_dim, dtype, device


class ShardedKVCache(KVCache):
    """Rank 0's KV cache (its own KV heads); every change is also sent to the other ranks."""

    def __init__(self, target: TensorParallelTarget, cache_id: int, max_slots: int, capacity: int):
        super().__init__(*_local_cache(target.plan, target.dtype, target.device, max_slots, capacity))
        self.cache_id = cache_id
        self._target = weakref.ref(target)
        weakref.finalize(self, target._freed.append, cache_id)

    def _send(self, op: str, meta: dict, tensors=(), local=None):
        return self._target()._call(op, dict(meta, cache=self.cache_id), tensors, local)

    def move_row(self, src: int, dst: int, length: int) -> None:
        if src == dst or length <= 0:
            return
        self._send("move_row", dict(src=src, dst=dst, length=length),
                   local=lambda: KVCache.move_row(self, src, dst, length))

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        self._send("grow", dict(capacity=capacity), local=lambda: KVCache.grow(self, capacity))

    def resize(self, max_slots: int, capacity: int, keep: int, length: int | None = None,
               reserve_rows: int | None = None) -> None:
        """(The ranks' caches reserve no rows: `reserve_rows` is not used here.)"""
        if max_slots == self.max_slots and capacity == self.capacity:
            return
        self._send("resize", dict(slots=max_slots, capacity=capacity, keep=keep, length=length),
                   local=lambda: KVCache.resize(self, max_slots, capacity, keep, length))

    def compact(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._send("compact", {}, (src, dst), local=lambda: KVCache.compact(self, src, dst))


# ---- the other ranks ---------------------------------------------------------------------

def follow(shard: nn.Module, group: TPGroup, step=None) -> None:
    """Ranks > 0: run rank 0's commands on this shard until it says stop."""
    channel = Channel(group)
    plan: ShardPlan = shard.tp_plan
    step = step or shard
    caches: dict[int, KVCache] = {}
    dtype, device = shard.dtype, shard.device
    with torch.inference_mode():
        while True:
            op, meta, tensors = channel.recv()
            for cid in meta.get("freed", ()):
                caches.pop(cid, None)
            if op == "forward":
                given = dict(zip(meta["names"], tensors))
                cache = None
                if meta["rows"] is not None:
                    cid, start, end = meta["rows"]
                    cache = caches[cid].rows(start, end)
                _run_step(step, shard, given["input_ids"], given.get("positions"), cache, given.get("logits_at"),
                          meta["kv_len"], given.get("slots"), given.get("attn_mask"), meta["hidden_at"])
            elif op == "new_cache":
                caches[meta["cache"]] = KVCache(*_local_cache(plan, dtype, device, meta["slots"], meta["capacity"]))
            elif op == "move_row":
                caches[meta["cache"]].move_row(meta["src"], meta["dst"], meta["length"])
            elif op == "grow":
                caches[meta["cache"]].grow(meta["capacity"])
            elif op == "resize":
                caches[meta["cache"]].resize(meta["slots"], meta["capacity"], meta["keep"], meta.get("length"))
            elif op == "compact":
                caches[meta["cache"]].compact(*tensors)
            elif op == "stop":
                return
            else:
                raise RuntimeError(f"unknown tensor-parallel command {op!r}")


def _load(spec: LoadSpec, group: TPGroup) -> nn.Module:
    cfg = ModelConfig.from_file(Path(spec.path) / "config.json")
    plan = ShardPlan(cfg, group.rank, group.world, spec.lm_head)
    shard = load_shard(Path(spec.path), plan, spec.dtype, group.device, Comm(None, group.rank, group.world),
                       spec.quantization)
    return prepare(shard, spec.quantization)


def _load_all(spec: LoadSpec, group: TPGroup) -> nn.Module:
    """Load this rank's shard; every rank learns whether all of them loaded."""
    shard, error = None, None
    try:
        shard = _load(spec, group)
    except Exception as exc:  # noqa: BLE001 - reported by rank 0
        error = str(exc) if isinstance(exc, QuickdraftError) else f"{type(exc).__name__}: {exc}"
    check_all(group, error)
    return shard


def _run_step(step, shard, input_ids, positions, cache, logits_at, kv_len, slots, attn_mask, hidden_at):
    """A rank's forward: its step (the shard or its compiled step) for logits; with hidden_at the
    shard's forward_hidden (compiled steps return logits only)."""
    if hidden_at is None:
        return step(input_ids, positions, cache, logits_at=logits_at, kv_len=kv_len, slots=slots, attn_mask=attn_mask)
    return shard.forward_hidden(input_ids, positions, cache, logits_at=logits_at, kv_len=kv_len, slots=slots,
                                attn_mask=attn_mask, hidden_at=tuple(hidden_at))


def _step(shard: nn.Module, spec: LoadSpec):
    """The forward each rank runs: the shard's own, or its compiled step (CUDA graphs on CUDA)."""
    if not spec.compile:
        return None
    from ..compile import StepFunction

    return StepFunction(shard, name="target shard", collective=True)  # a failure stops every rank, no eager retry


def _worker(spec: LoadSpec, group: TPGroup) -> None:
    try:
        shard = _load_all(spec, group)
        follow(shard, group, _step(shard, spec))
    except BaseException:  # noqa: BLE001 - a worker's failure ends its process; rank 0 sees the group fail
        print(f"quickdraft: tensor-parallel rank {group.rank} failed:\n{traceback.format_exc()}", file=sys.stderr,
              flush=True)
        os._exit(1)


def spawned_worker_main(rank: int, world: int, port: int, secret: str, spec: LoadSpec) -> None:
    """The entry point of a worker process rank 0 spawned (`secret`: the launch's rendezvous key)."""
    watch_parent()
    if spec.device == "cpu":
        torch.set_num_threads(spec.threads)
    try:
        group = init_spawned(rank, world, port, secret, torch.device(spec.device), spec.timeout_s)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        os._exit(1)
    _worker(spec, group)
    os._exit(0)


_OPEN: dict[LoadSpec, TensorParallelTarget] = {}  # the open group of this process, by what it loaded


def load_tensor_parallel(path: Path, world: int, dtype=None, device: torch.device = torch.device("cpu"),
                         quantization: str | None = None, lm_head: str = "rank0",
                         timeout_s: float = DEFAULT_TIMEOUT_S, compile: bool = False) -> TensorParallelTarget:
    """The target split over `world` ranks. Started here (spawned workers) or, under torchrun,
    joining its processes: there ranks > 0 follow rank 0 until it closes the group and then end
    the process (`SystemExit(0)`), so a script's code after LLM(...) runs on rank 0 only.
    A process holds one group: a second LLM over the same target and settings shares it (each
    with its own KV caches); release() when done."""
    if gguf_source(path) is None and not any(path.glob("*.safetensors*")):  # gguf_source: a GGUF's metadata folder
        raise QuickdraftError("tensor parallelism loads safetensors checkpoint folders or GGUF files (each rank "
                              f"reads its slice); {path} has neither")
    check_tensor_parallel(ModelConfig.from_file(path / "config.json"), world)
    ShardPlan(ModelConfig.from_file(path / "config.json"), 0, world, lm_head)  # validates lm_head early
    if not timeout_s > 0:
        raise QuickdraftError(f"the tensor-parallel timeout must be > 0 s, got {timeout_s}")
    threads = max(1, torch.get_num_threads() // world)
    spec = LoadSpec(str(path), world, dtype, device.type, quantization, lm_head, timeout_s, threads, bool(compile))
    key = dataclasses.replace(spec, threads=0)
    if key in _OPEN:
        _OPEN[key].users += 1
        return _OPEN[key]
    if _OPEN or (dist.is_initialized() and not under_torchrun()):
        raise QuickdraftError("another tensor-parallel target is open in this process (one group per process): "
                              "close() the LLM holding it first")
    if device.type == "cpu" and not under_torchrun():
        torch.set_num_threads(threads)  # rank 0 too: the spawned ranks share this machine's cores
    if under_torchrun():
        group = init_torchrun(world, device, timeout_s)
        if group.rank != 0:
            _worker(spec, group)
            # leave the group before the interpreter exits: a gloo group still open at exit can
            # abort the process ("terminate called without an active exception") while rank 0 leaves
            dist.destroy_process_group()
            raise SystemExit(0)
    else:
        group = start_spawned(world, device, timeout_s, spawned_worker_main, (spec,))
    try:
        shard = _load_all(spec, group)
    except BaseException:
        for p in group.workers or ():
            p.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    target = TensorParallelTarget(shard, group, _step(shard, spec))
    target.key = key
    _OPEN[key] = target
    atexit.register(target.close)
    return target
