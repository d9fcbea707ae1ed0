"""Fixtures of the server tests that start one `server` per module: an OpenAI client of it and
the plain-decoding reference its outputs are compared with."""

from __future__ import annotations

import openai
import pytest

from quickdraft import LLM


@pytest.fixture(scope="module")
def client(server):
    """The openai client of the module's `server` fixture."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def plain(target_dir):
    """Plain decoding of the test target (the reference of greedy outputs)."""
    return LLM(target_dir, method="none", policy="fixed")
