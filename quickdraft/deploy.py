"""Replicas behind Ray Serve (the optional extra: `pip install -e ".[ray]"`).

Each replica is a whole quickdraft server (the same FastAPI app and OpenAI routes as
`quickdraft serve`, streaming included), optionally tensor-parallel within itself; Ray Serve's
HTTP proxy spreads requests over them with its default power-of-two-choices router (of two
replicas drawn at random, the one with fewer requests in flight), restarts a replica that dies
or fails its health check, and can scale. Nothing here routes or balances by itself.

    quickdraft serve --replicas 2 [serve's options]            # starts a local Ray cluster
    serve run quickdraft.deploy:app                             # the bundled pair, 2 replicas
    serve run quickdraft.deploy:build replicas=2 target=PATH method=ngram tensor_parallel_size=2

Each replica reports its running / waiting requests and speculation metrics to Ray Serve
(`record_routing_stats`, what a custom request router reads) and on its own /metrics.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

try:
    from ray import serve
except ImportError as exc:  # the extra is not installed
    raise ImportError('Ray Serve replicas need the ray extra: pip install -e ".[ray]"') from exc

from .config import DEFAULT_MAX_NUM_SEQS
from .errors import QuickdraftError

DEPLOYMENT = "quickdraft"


@serve.ingress()
class QuickdraftReplica:
    """One engine and its OpenAI app; Ray Serve runs `replicas` of these."""

    def __init__(self, llm_kwargs: dict[str, Any], served_model_name: str, max_queue: int, threads: int | None,
                 api_key: str | None = None, allowed_origins: list[str] | None = None,
                 chat_template: str | None = None, web: bool = True):
        import torch

        from .llm import LLM
        from .server.state import ServerState

        if threads:
            torch.set_num_threads(threads)
        self.llm = LLM(**dict(llm_kwargs, preallocate=True))  # loaded before the replica takes requests
        self.state = ServerState(lambda: self.llm, served_model_name, max_queue=max_queue, chat_template=chat_template)
        self.access = (api_key, allowed_origins)
        self.web = web

    def __serve_build_asgi_app__(self):
        from .server.app import build_app

        api_key, origins = self.access
        return build_app(self.state, api_key=api_key, allowed_origins=origins, web=self.web)

    def record_routing_stats(self) -> dict[str, float]:
        """What this replica reports to Ray Serve: its load and how well it speculates."""
        engine = self.state.engine
        stats = self.llm.engine.stats
        return {"running": engine.num_running if engine else 0, "waiting": engine.num_waiting if engine else 0,
                "acceptance_rate": stats.acceptance_rate, "mean_acceptance_length": stats.mean_acceptance_length,
                "tokens_per_step": stats.tokens_per_step, "spec_decode_num_drafts": stats.num_drafts}

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes it replace the replica."""
        engine = self.state.engine
        if engine is not None and engine.dead is not None:
            raise RuntimeError(engine.dead)

    def __del__(self):
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.close()


def deployment(llm_kwargs: dict[str, Any], replicas: int, served_model_name: str = "quickdraft-default",
               max_queue: int = 256, cpus_per_replica: float | None = None, gpus_per_replica: float = 0,
               api_key: str | None = None, allowed_origins: list[str] | None = None, chat_template: str | None = None,
               threads: int | None = None, web: bool = True):
    """The Ray Serve application: `replicas` engines over `llm_kwargs` (LLM's arguments), each
    serving with `quickdraft serve`'s options (served name, queue, API key, CORS, chat template, web page).
    threads: torch's CPU threads in each replica (default: on CPUs, the replica's share of the cores)."""
    if replicas < 1:
        raise QuickdraftError(f"--replicas must be >= 1, got {replicas}")
    max_num_seqs = int(llm_kwargs.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS))
    tp = int(llm_kwargs.get("tensor_parallel_size", 1))
    if gpus_per_replica == 0 and llm_kwargs.get("device") in ("cuda", "auto", None):
        import torch

        gpus_per_replica = tp if torch.cuda.is_available() else 0  # one GPU per tensor-parallel rank
    if cpus_per_replica is None:  # share this machine's cores
        cpus_per_replica = max(1, (os.cpu_count() or 1) // replicas)
    if threads is None and not gpus_per_replica:
        threads = max(1, int(cpus_per_replica))
    return serve.deployment(
        QuickdraftReplica, name=DEPLOYMENT, num_replicas=replicas,
        # a replica takes up to a full batch plus its own queue; beyond that the router holds requests
        # and sends each to the less loaded of two replicas as room frees up
        max_ongoing_requests=max_num_seqs + max_queue,
        ray_actor_options={"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica},
        health_check_period_s=2, health_check_timeout_s=30,
    ).bind(llm_kwargs, served_model_name, max_queue, threads, api_key, allowed_origins, chat_template,
           web)


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


_SERVER_NUMBERS = ("replicas", "max_queue", "cpus_per_replica", "gpus_per_replica", "threads", "web")
_SERVER_TEXT = ("served_model_name", "api_key", "allowed_origins", "chat_template")  # kept as written


def build(args: dict[str, str]):
    """`serve run quickdraft.deploy:build replicas=2 target=... method=...`: LLM's keyword
    arguments as key=value (numbers and true/false parsed), plus the server's own: replicas,
    served_model_name, max_queue, cpus_per_replica, gpus_per_replica, threads, web, api_key,
    allowed_origins (comma-separated) and chat_template (a file's path), which go to each
    replica's app, not to LLM()."""
    raw = {k: str(v) for k, v in args.items()}
    own: dict[str, Any] = {k: raw.pop(k) for k in _SERVER_TEXT if k in raw}
    own.update({k: _value(raw.pop(k)) for k in _SERVER_NUMBERS if k in raw})
    kwargs = {k: _value(v) for k, v in raw.items()}
    if "allowed_origins" in own:
        own["allowed_origins"] = [o.strip() for o in own["allowed_origins"].split(",") if o.strip()]
    if own.get("api_key") == "":
        own["api_key"] = None
    if "chat_template" in own:
        try:
            own["chat_template"] = Path(own["chat_template"]).expanduser().read_text()
        except OSError as exc:
            raise QuickdraftError(f"cannot read chat_template {own['chat_template']}: {exc.strerror or exc}") from None
    return deployment(kwargs, int(own.pop("replicas", 2)), **own)


app = build({"replicas": "2"})  # `serve run quickdraft.deploy:app`: the bundled pair, 2 replicas
