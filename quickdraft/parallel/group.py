"""The tensor-parallel process group: started by quickdraft itself (spawned workers) or by
`torchrun`, over torch.distributed (`nccl` on CUDA, which ROCm's PyTorch maps to RCCL; `gloo` on
CPU), and the control channel rank 0 drives the other ranks through.

Two groups:
- compute (the default group): the all-reduces of the forward and the step's input tensors,
  with `timeout` so a dead or stuck rank turns into an error, never a hang;
- control (gloo, CPU): the small header of each command. Workers wait on it between steps for
  as long as the server is idle, so it has no practical timeout; a rank 0 that dies closes its
  sockets (the wait fails), and a spawned worker also exits when its parent is gone.

Spawned ranks meet on a TCP store bound to 127.0.0.1, which any local user can connect to. Every
key of the group lives under a secret generated per launch (`secrets.token_hex`, 256 bits) and
handed to the workers in their spawn arguments (a pipe, not the command line): a process without
it can neither read nor write the rendezvous, nor be taken for a rank. And nothing a rank sends is
unpickled: status and command headers travel as JSON in byte tensors (`send_json`, `gather_json`).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import EngineFailure, QuickdraftError

DEFAULT_TIMEOUT_S = 60.0  # a collective (or start-up rendezvous) waiting longer than this fails
_IDLE = datetime.timedelta(days=365)  # workers wait for rank 0's next command this long


class RankFailure(EngineFailure):
    """A tensor-parallel rank died or a collective timed out: the group cannot go on."""


@dataclass
class TPGroup:
    rank: int
    world: int
    device: torch.device
    control: object  # the gloo group commands travel on
    timeout_s: float
    launcher: str  # "spawn" | "torchrun"
    workers: list | None = None  # rank 0 after spawning: the worker processes

    @property
    def backend(self) -> str:
        return dist.get_backend()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "MASTER_ADDR" in os.environ)


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """Each rank's own accelerator (cuda:LOCAL_RANK); CPU ranks share the CPU."""
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise QuickdraftError(f"tensor-parallel rank {local_rank} has no GPU: {torch.cuda.device_count()} visible")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if device.type != "cpu":
        raise QuickdraftError(f"tensor parallelism runs on CUDA/ROCm (nccl) or CPU (gloo), not {device.type}")
    return device


def _init(store, rank: int, world: int, device: torch.device, timeout_s: float, launcher: str) -> TPGroup:
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=_IDLE)
    return TPGroup(rank, world, device, control, timeout_s, launcher)


def init_torchrun(world: int, device: torch.device, timeout_s: float) -> TPGroup:
    """Join the group torchrun started (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)."""
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world:
        raise QuickdraftError(f"tensor_parallel_size {world} but torchrun started {env_world} processes "
                              "(use --nproc-per-node equal to --tensor-parallel-size)")
    local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    return _init(None, int(os.environ["RANK"]), world, rank_device(device, local), timeout_s, "torchrun")


def _private(store, secret: str):
    """The store's keys under this launch's secret: invisible to anyone who does not hold it."""
    return dist.PrefixStore(f"quickdraft/{secret}", store)


def init_spawned(rank: int, world: int, port: int, secret: str, device: torch.device, timeout_s: float) -> TPGroup:
    """A worker that rank 0 spawned joins the group rank 0's store hosts (under the launch's secret)."""
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    private = _private(store, secret)
    private.set(f"ready/{rank}", "1")
    group = _init(private, rank, world, rank_device(device, rank), timeout_s, "spawn")
    group.store = store
    return group


def start_spawned(world: int, device: torch.device, timeout_s: float, worker_main, args: tuple) -> TPGroup:
    """Rank 0: host the rendezvous store, spawn ranks 1..world-1 running
    `worker_main(rank, world, port, secret, *args)`, wait for them (failing clearly if one exits
    during start-up) and join the group. `secret` (new for each launch, given to the workers
    through the spawn pipe) names every key of the rendezvous."""
    import multiprocessing as mp

    port = free_port()
    secret = secrets.token_hex(32)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    private = _private(store, secret)
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, world):
        p = ctx.Process(target=worker_main, args=(rank, world, port, secret, *args), daemon=True,
                        name=f"quickdraft-tp-rank{rank}")
        p.start()
        procs.append(p)
    deadline = time.monotonic() + timeout_s
    try:
        for rank, p in enumerate(procs, start=1):
            while not private.check([f"ready/{rank}"]):
                if p.exitcode is not None:
                    raise RankFailure(f"tensor-parallel rank {rank} exited with code {p.exitcode} while starting")
                if time.monotonic() > deadline:
                    raise RankFailure(f"tensor-parallel rank {rank} did not start within {timeout_s:.0f} s")
                time.sleep(0.05)
        group = _init(private, 0, world, rank_device(device, 0), timeout_s, "spawn")
    except BaseException:
        for p in procs:
            p.terminate()
        raise
    group.workers = procs
    group.store = store  # the store must outlive the group
    return group


def watch_parent() -> None:
    """A spawned worker ends itself when rank 0's process is gone (e.g. killed)."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, name="quickdraft-tp-parent", daemon=True).start()


MAX_MESSAGE_BYTES = 1 << 20  # a status or command header longer than this is refused


def _decode(data: bytes, source: str):
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise QuickdraftError(f"{source} sent a malformed message ({len(data)} bytes that are not JSON)") from None


def _encode(value) -> torch.Tensor:
    data = json.dumps(value).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise QuickdraftError(f"a tensor-parallel message of {len(data)} bytes (at most {MAX_MESSAGE_BYTES})")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def gather_json(group: TPGroup, value) -> list:
    """Every rank's `value` (JSON data), on every rank, over the control group: two all-gathers
    of tensors (lengths, then the bytes), never a pickle."""
    data = _encode(value)
    sizes = torch.zeros(group.world, dtype=torch.int64)
    dist.all_gather(list(sizes.split(1)), torch.tensor([data.numel()], dtype=torch.int64), group=group.control)
    cap = int(sizes.max())
    if cap > MAX_MESSAGE_BYTES or int(sizes.min()) < 0:
        raise QuickdraftError(f"a tensor-parallel rank sent a message of {cap} bytes (at most {MAX_MESSAGE_BYTES})")
    padded = torch.zeros(cap, dtype=torch.uint8)
    padded[:data.numel()] = data
    out = torch.zeros(group.world * cap, dtype=torch.uint8)
    dist.all_gather(list(out.split(cap)) if cap else [torch.zeros(0, dtype=torch.uint8)] * group.world, padded,
                    group=group.control)
    return [_decode(bytes(out[r * cap: r * cap + int(n)].tolist()), f"tensor-parallel rank {r}")
            for r, n in enumerate(sizes.tolist())]


def send_json(group: TPGroup, value=None):
    """Rank 0's `value` (JSON data) to every rank over the control group (pass nothing to
    receive): the length, then the bytes, never a pickle."""
    data = _encode(value) if group.rank == 0 else None
    size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group.control)
    n = int(size)
    if not 0 <= n <= MAX_MESSAGE_BYTES:
        raise QuickdraftError(f"tensor-parallel rank 0 sent a message of {n} bytes (at most {MAX_MESSAGE_BYTES})")
    if group.rank == 0:
        if n:
            dist.broadcast(data, src=0, group=group.control)
        return value
    buf = torch.zeros(n, dtype=torch.uint8)
    if n:
        dist.broadcast(buf, src=0, group=group.control)
    return _decode(bytes(buf.tolist()), "tensor-parallel rank 0")


def check_all(group: TPGroup, error: str | None) -> None:
    """After loading: every rank says whether its shard loaded; rank 0 raises the first error."""
    errors = gather_json(group, error)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        rank, message = bad[0]
        raise QuickdraftError(f"tensor-parallel rank {rank}: {str(message)[:2000]}")


def elements(shape) -> int:
    return math.prod(shape)
