"""The spawned ranks' rendezvous and messages cannot be used by another local user: the store's
keys live under a secret made per launch (a client without it sees none and cannot stand in for
a rank), and what a rank sends is JSON in byte tensors, never unpickled (a rank that sends a
pickle gets a clear error on rank 0, and its code does not run)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from quickdraft.errors import QuickdraftError
from quickdraft.bench.serve_load.launch import free_port
from quickdraft.parallel import group as tp_group


class Payload:
    """A pickle that runs code where it is loaded: it creates the file `marker`."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _pickling_rank(port: int, marker: str) -> None:
    """Rank 1 of a plain gloo group that answers rank 0's status exchange with a pickle."""
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=datetime.timedelta(seconds=30))
    control = dist.new_group(backend="gloo")
    try:
        dist.all_gather_object([None, None], Payload(marker), group=control)
    finally:
        dist.destroy_process_group()


def test_a_rank_that_sends_a_pickle_gets_an_error_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    port = free_port()
    ctx = mp.get_context("spawn")
    worker = ctx.Process(target=_pickling_rank, args=(port, str(marker)), daemon=True)
    worker.start()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=datetime.timedelta(seconds=30))
    try:
        control = dist.new_group(backend="gloo")
        group = tp_group.TPGroup(0, 2, torch.device("cpu"), control, 30.0, "spawn")
        with pytest.raises(QuickdraftError, match="rank 1 sent a malformed message"):
            tp_group.check_all(group, None)
        worker.join(30)
        assert not marker.exists()  # the pickle was never loaded
    finally:
        dist.destroy_process_group()
        if worker.is_alive():
            worker.terminate()


def _idle_rank(rank: int, world: int, port: int, secret: str, wrong: bool) -> None:
    """A spawned worker: joins with the launch's secret (or a wrong one), then waits for rank 0."""
    try:
        group = tp_group.init_spawned(rank, world, port, "0" * 64 if wrong else secret, torch.device("cpu"), 5.0)
        tp_group.check_all(group, None)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a wrong secret never meets rank 0
        os._exit(1)


def test_the_rendezvous_keys_are_under_the_launch_secret():
    group = tp_group.start_spawned(2, torch.device("cpu"), 30.0, _idle_rank, (False,))
    try:
        stranger = dist.TCPStore("127.0.0.1", group.store.port, 2, is_master=False,
                                 timeout=datetime.timedelta(seconds=5))
        assert not stranger.check(["quickdraft/ready/1"])  # what a rank writes is not where others look
        tp_group.check_all(group, None)  # the real rank is in the group
    finally:
        dist.destroy_process_group()
        for p in group.workers:
            p.join(10)


def test_a_rank_without_the_secret_is_not_admitted():
    start = time.monotonic()
    with pytest.raises(tp_group.RankFailure, match="did not start|exited"):
        tp_group.start_spawned(2, torch.device("cpu"), 4.0, _idle_rank, (True,))
    assert time.monotonic() - start < 30
    assert not dist.is_initialized()
