"""A compiled step that fails on one tensor-parallel rank is not re-run eagerly on that rank
alone (its all-reduces would meet the other ranks' compiled ones, or none): the failure is
raised and the whole group stops, the same way on every rank (real processes, gloo)."""

from __future__ import annotations

import logging
import time

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.compile import StepFunction
from quickdraft.errors import EngineFailure


def test_a_failed_compiled_step_on_one_rank_stops_the_group(target_dir, caplog):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("injected compile failure on rank 0")

    llm = LLM(target_dir, method="none", tensor_parallel_size=2)
    try:
        target = llm.target
        target._modules.pop("step", None)  # (eager ranks: the step is the shard module itself)
        target.step = StepFunction(target.shard, name="target shard", collective=True, backend=broken_backend)
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="quickdraft"), pytest.raises(EngineFailure) as err:
            llm.generate([[0, 5, 7]], SamplingParams(temperature=0, max_tokens=4))
        assert time.monotonic() - start < 60
        assert "not re-run eagerly" in str(err.value) and "injected compile failure" in str(err.value)
        assert "running it eagerly" not in caplog.text
        with pytest.raises(EngineFailure):  # and the group stays stopped
            llm.generate([[0, 5]], SamplingParams(temperature=0, max_tokens=2))
    finally:
        llm.close()


def test_a_single_process_step_still_falls_back(target_dir):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("no compiler here")

    llm = LLM(target_dir, method="none")
    step = StepFunction(llm.target, name="target", backend=broken_backend)
    llm.engine._forward = step
    out = llm.generate([[0, 5, 7]], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.token_ids) == 4 and step.failed and "no compiler here" in step.failed
