"""The AOT steps built in the background by default (quickdraft.aot.BackgroundBuild): a CPU
engine without cached packages decodes eagerly at once, switches to the packages a low-priority
process builds at a step boundary with the same tokens, and later engines load them; a build
that fails or is killed leaves nothing half-written and never blocks the next one (BuildLock)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from quickdraft import aot
from quickdraft.llm import LLM
from quickdraft.model.loader import load_model
from quickdraft.model.quant import prepare
from quickdraft.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPT = [3, 17, 42, 9, 5]


@pytest.fixture
def empty_aot_dir(tmp_path, monkeypatch):
    """No package cached: this test's own folder instead of the session's."""
    monkeypatch.setattr("quickdraft.aot.aot_dir", lambda: tmp_path)
    return tmp_path


def _write_lock(package, **info):
    lock = aot.BuildLock(package)
    lock.path.write_text(json.dumps(info))
    return lock


def test_lock_of_a_dead_process_is_broken(tmp_path, caplog):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(done.stdout)
    lock = _write_lock(tmp_path / "x.pt2", pid=dead, host=socket.gethostname(), created=time.time(), token="t")
    assert lock.stale() == f"its process {dead} is gone"
    with caplog.at_level(logging.WARNING, logger="quickdraft"):
        with aot.BuildLock(tmp_path / "x.pt2") as held:
            assert json.loads(held.path.read_text())["pid"] == os.getpid()
    assert "breaking the AOT build lock" in caplog.text
    assert not lock.path.exists()  # released


def test_lock_not_touched_or_too_old_is_stale(tmp_path):
    now = time.time()
    live = dict(pid=os.getpid(), host=socket.gethostname(), token="t")
    lock = _write_lock(tmp_path / "a.pt2", created=now, **live)
    assert lock.stale() is None  # this process holds it and it was just touched
    os.utime(lock.path, (now - 120, now - 120))
    assert lock.stale().startswith("not touched for")  # a holder on another machine, stopped
    lock = _write_lock(tmp_path / "b.pt2", created=now - 2 * aot.BuildLock.MAX_S, **live)
    assert lock.stale().startswith("held for")


def test_second_builder_waits_for_the_first(tmp_path, monkeypatch):
    monkeypatch.setattr(aot.BuildLock, "POLL_S", 0.05)
    order = []
    first = aot.BuildLock(tmp_path / "p.pt2").__enter__()

    def second():
        with aot.BuildLock(tmp_path / "p.pt2"):
            order.append("second")

    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.5)
    order.append("first")
    first.__exit__(None, None, None)
    t.join(10)
    assert order == ["first", "second"]
    assert not first.path.exists()


def test_failed_build_leaves_nothing(target_dir, empty_aot_dir, monkeypatch):
    """A build that dies inside the compiler (as a killed one would) leaves no package, no
    temporary file and no lock; a temporary file a killed build left is removed by the next."""
    model = prepare(load_model(target_dir, dtype="float32"))
    path = aot.package_path(model)
    leftover = path.with_name(f"{path.stem}.999999.tmp.pt2")
    leftover.write_bytes(b"half")

    def dies(program, package_path, inductor_configs):
        with open(package_path, "wb") as f:
            f.write(b"half a package")
        raise RuntimeError("killed")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", dies)
    with pytest.raises(RuntimeError, match="killed"):
        aot.build(model)
    assert list(empty_aot_dir.iterdir()) == []
    assert aot.load(model) is None


def test_engine_stays_eager_when_the_background_build_fails(target_dir, empty_aot_dir, caplog):
    plain = LLM(target_dir, method="none", compile=False, dtype="float32")
    llm = LLM(target_dir, method="none", dtype="float32")  # compile=None: "auto"
    assert llm.aot_build is None and llm.engine.aot_missing == ["the target"]  # QUICKDRAFT_AOT_BUILD=0 (conftest)
    failing = aot.BackgroundBuild("sys.exit", "the compiler died", "failing")
    assert failing.wait(60)
    llm.engine.switch_when_built(failing)
    with caplog.at_level(logging.WARNING, logger="quickdraft"):
        got = llm.generate([PROMPT], GREEDY)
    assert got[0].token_ids == plain.generate([PROMPT], GREEDY)[0].token_ids
    assert llm.engine._forward is llm.target
    lines = [r.getMessage() for r in caplog.records if "background AOT build failed" in r.getMessage()]
    assert len(lines) == 1 and "exit status 1: the compiler died" in lines[0]
    llm.generate([PROMPT], GREEDY)
    assert len([r for r in caplog.records if "background AOT build failed" in r.getMessage()]) == 1


@pytest.mark.slow
def test_background_build_switches_between_requests(target_dir, draft_dir, empty_aot_dir, monkeypatch):
    """By default (compile=None) a CPU engine without packages starts their build in another
    process and decodes eagerly; once the build has ended and its packages are loaded, it switches
    to the target's and the draft's packages at the first step boundary with no request in flight
    (never between two steps of a request: the packages round differently from the eager steps),
    and both requests' output equals plain eager decoding. The next engine of these models loads
    them at once (a warm start)."""
    monkeypatch.setenv("QUICKDRAFT_AOT_BUILD", "1")
    plain = LLM(target_dir, method="none", compile=False, dtype="float32")
    want = plain.generate([PROMPT], GREEDY)[0].token_ids
    llm = LLM(target_dir, draft_dir, method="draft", num_speculative_tokens=3, dtype="float32", policy="fixed")
    assert llm.aot_build is not None and llm.engine.aot_missing == ["the target", "the draft"]
    engine = llm.engine

    def run() -> tuple[list[int], list[bool]]:
        rid = engine.add_request(PROMPT, GREEDY)
        packaged, tokens = [], []
        for i in range(60):
            if i == 3 and engine._pending_build is not None:  # the build awaited: the next step loads its packages
                assert llm.aot_build.wait(600), "the background build did not finish in 10 minutes"
                assert llm.aot_build.failure() is None, llm.aot_build.failure()
            if i == 4 and engine._loading is not None:  # (in a thread, while steps go on) awaited here
                engine._loading.join()
            for out in engine.step():
                assert out.request_id == rid
                tokens += out.new_token_ids
            packaged.append(isinstance(engine._forward, aot.AOTStep))
            if not engine.has_unfinished():
                return tokens, packaged
        raise AssertionError("the request did not finish in 60 steps")

    tokens, packaged = run()
    assert len(packaged) > 5 and not any(packaged)  # loaded during the request, not switched to
    assert engine._pending_build is not None and engine._ready_at is not None
    assert tokens == want
    tokens, packaged = run()  # the first step of the next request switches, before admitting it
    assert all(packaged) and isinstance(engine.proposer._step, aot.AOTStep) and engine.aot_missing == []
    assert tokens == want
    # no lock, no temporary file: the packages, and the build's log and pid file (running_build's)
    assert sorted(p.suffix for p in empty_aot_dir.iterdir()) == [".log", ".pid", ".pt2", ".pt2"]
    warm = LLM(target_dir, draft_dir, method="draft", num_speculative_tokens=3, dtype="float32", policy="fixed")
    assert warm.aot_build is None and isinstance(warm.engine._forward, aot.AOTStep)
    assert warm.generate([PROMPT], GREEDY)[0].token_ids == want


class _Ended:
    """A background build that has ended well (its packages: whatever _use_packages finds)."""

    started = time.perf_counter()

    def done(self) -> bool:
        return True

    def wait(self, timeout=None) -> bool:
        return True

    def failure(self) -> None:
        return None


def _fake_switch(engine, monkeypatch) -> list[int]:
    """The engine's switch recorded (the requests in flight at it), its packages not loaded."""
    switched: list[int] = []
    monkeypatch.setattr(engine, "_preload", lambda: setattr(engine, "_loaded", {}))
    monkeypatch.setattr(engine, "_use_packages",
                        lambda make: switched.append(len(engine.running) + len(engine.prefilling)) or [])
    return switched


def test_the_switch_waits_for_no_request_in_flight(target_dir, monkeypatch):
    llm = LLM(target_dir, method="none", dtype="float32")  # no package cached, no background build (conftest)
    engine = llm.engine
    switched = _fake_switch(engine, monkeypatch)
    engine.add_request(PROMPT, GREEDY)
    engine.step()
    engine.switch_when_built(_Ended())
    while engine.has_unfinished():
        engine.step()
        if engine._loading is not None:
            engine._loading.join()
    assert switched == [] and engine._ready_at is not None and not engine._draining
    assert llm.generate([PROMPT], GREEDY)[0].token_ids  # its first step switches, before admitting
    assert switched == [0] and engine._pending_build is None


def test_under_constant_load_the_switch_drains_the_batch_once(target_dir, monkeypatch):
    """Past AOT_SWITCH_DRAIN_S with requests in flight, new requests wait until those finish;
    then the switch, then they are admitted."""
    monkeypatch.setattr("quickdraft.engine.AOT_SWITCH_DRAIN_S", 0.0)
    plain = LLM(target_dir, method="none", compile=False, dtype="float32")
    llm = LLM(target_dir, method="none", dtype="float32")
    engine = llm.engine
    switched = _fake_switch(engine, monkeypatch)
    first = engine.add_request(PROMPT, GREEDY)
    tokens: dict[str, list[int]] = {first: []}
    for out in engine.step():
        tokens[first] += out.new_token_ids
    engine.switch_when_built(_Ended())
    for out in engine.step():  # starts loading (a thread)
        tokens[first] += out.new_token_ids
    engine._loading.join()
    for out in engine.step():  # loaded, a request in flight: no switch; draining from now on
        tokens[first] += out.new_token_ids
    assert engine._draining and switched == []
    second = engine.add_request(PROMPT[:3], GREEDY)
    tokens[second] = []
    order = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                order.append(out.request_id)
        if engine.running and engine.running[0].id == second:
            assert switched == [0]  # the second was admitted only after the switch
    assert order == [first, second] and switched == [0] and not engine._draining
    assert tokens[first] == plain.generate([PROMPT], GREEDY)[0].token_ids
    assert tokens[second] == plain.generate([PROMPT[:3]], GREEDY)[0].token_ids


def _group_nice(text: str) -> str | None:
    """The nice value in a /proc/<pid>/autogroup line ("/autogroup-46 nice 0"); None where the file
    is empty: Linux leaves it empty for a process in the system's root group (one whose session began
    before any autogroup, as a CI runner's can), where the group's nice is not the process's to set."""
    words = text.split()
    return words[-1] if words else None


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="no Linux autogroups here")
def test_a_build_in_its_own_session_lowers_its_scheduling_group():
    """A build leads its own session, so Linux schedules it in a group of its own, where its nice
    value alone would not yield a shared core to decoding: lower_priority gives the group nice 10
    too, and leaves the group of a process that shares its session (a user's shell) as it is."""
    code = ("import os; from quickdraft.aot import lower_priority; lower_priority(); "
            "print(os.nice(0)); print(open('/proc/self/autogroup').read().strip())")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    own = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         start_new_session=True)
    assert own.returncode == 0, own.stderr
    nice, _, group = own.stdout.partition("\n")
    assert nice == "10"  # the process's own nice value, wherever it runs
    assert _group_nice(group) in ("10", None)  # and its group's, where an autogroup schedules it
    before = _group_nice(open("/proc/self/autogroup").read())
    shared = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert shared.returncode == 0, shared.stderr
    assert shared.stdout.split("\n")[0] == "10"
    assert _group_nice(shared.stdout.partition("\n")[2]) == before == _group_nice(open("/proc/self/autogroup").read())


def test_a_run_waits_for_the_build_another_process_runs_for_the_same_recipe(target_dir, empty_aot_dir, monkeypatch,
                                                                             caplog):
    """Short runs in a row while the packages build: a later run finds the earlier one's build
    (its pid file, a live process with the same recipe) and waits for it instead of starting its
    own (each such start held a Python process waiting on the first one's lock). A pid file of a
    process with another recipe, or of one that has ended (a zombie too), starts a build."""
    import hashlib
    import types

    plain = LLM(target_dir, method="none", compile=False, dtype="float32")
    llm = LLM(target_dir, method="none", dtype="float32")  # compile=None: "auto"
    recipe = {"target": str(target_dir), "method": "none"}
    payload = json.dumps(recipe, sort_keys=True)
    name = hashlib.sha256(payload.encode()).hexdigest()[:12]
    started = []

    def start(*args):  # (a build started here: recorded, never run)
        started.append(args)
        return types.SimpleNamespace(pid=0, log_path="-", done=lambda: False)

    monkeypatch.setattr(aot, "BackgroundBuild", start)
    # the earlier run's build, as BackgroundBuild starts one (the same command line's shape)
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # build_aot", payload])
    cmdline = f"/proc/{first.pid}/cmdline"
    for _ in range(200):  # (its command line reads empty for a moment after the start, on a loaded machine)
        if open(cmdline, "rb").read():
            break
        time.sleep(0.05)
    try:
        (empty_aot_dir / f"build-{name}.pid").write_text(str(first.pid))
        with caplog.at_level(logging.WARNING, logger="quickdraft"):
            llm._build_in_background(recipe)
        assert started == [] and isinstance(llm.aot_build, aot.RunningBuild) and llm.aot_build.pid == first.pid
        assert any("compiled by another process" in r.getMessage() for r in caplog.records)
        assert not llm.aot_build.done() and not llm.aot_build.wait(0.3)
        assert 0 <= time.perf_counter() - llm.aot_build.started < 60  # (its age: the switch's log line says it)
        assert aot.running_build(name, payload.replace("none", "suffix")) is None  # another recipe
        got = llm.generate([PROMPT], GREEDY)  # eager meanwhile
        first.kill()
        assert llm.aot_build.wait(30)  # ended: a zombie until reaped counts as ended
        assert aot.running_build(name, payload) is None
    finally:
        first.kill()
        first.wait()
    assert got[0].token_ids == llm.generate([PROMPT], GREEDY)[0].token_ids == plain.generate([PROMPT], GREEDY)[0].token_ids
    assert llm.engine._forward is llm.target  # no packages were left: still eager
    llm._build_in_background(recipe)  # nothing running now: this run starts its own
    assert len(started) == 1
    # an adopted build that left packages: the engine switches to them (here faked) as to its own
    switched = _fake_switch(llm.engine, monkeypatch)
    llm.engine.switch_when_built(aot.RunningBuild(first.pid, empty_aot_dir / "build.log"))
    with caplog.at_level(logging.INFO, logger="quickdraft"):
        assert llm.generate([PROMPT], GREEDY)[0].token_ids == got[0].token_ids
    assert switched == [0] and llm.engine._pending_build is None
    assert any("switched to the AOT steps built in the background" in r.getMessage() for r in caplog.records)
