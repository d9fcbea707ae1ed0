"""`quickdraft serve`: the OpenAI-compatible server (quickdraft.server) on uvicorn."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from ..errors import EngineFailure, QuickdraftError
from ..config import SELF_DRAFT
from ..model.sources import check_spec
from . import common as opts
from .common import fail, parse_spec_options, user_errors


@user_errors
def serve_command(
    target: Optional[str] = opts.TARGET,
    draft: Optional[str] = opts.DRAFT,
    method: Optional[str] = opts.METHOD,
    k: Optional[int] = opts.PROFILED_NUM_SPECULATIVE_TOKENS,
    spec_option: Optional[list[str]] = opts.SPEC_OPTION,
    policy: str = opts.POLICY,
    profile: Optional[Path] = opts.PROFILE,
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    max_num_seqs: int = opts.MAX_NUM_SEQS,
    max_num_batched_tokens: str = opts.MAX_NUM_BATCHED_TOKENS,
    enable_prefix_caching: Optional[bool] = opts.ENABLE_PREFIX_CACHING,
    prefix_cache_check: Optional[bool] = opts.PREFIX_CACHE_CHECK,
    max_queue: int = typer.Option(256, "--max-queue", help="Requests waiting for a slot at most (then 429)."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Tokens per request, prompt and "
                                                "answer (default: the model's context, or what --kv-cache-memory "
                                                "holds for one request if less)."),
    kv_cache_memory: Optional[str] = opts.KV_CACHE_MEMORY,
    kv_cache_dtype: str = opts.KV_CACHE_DTYPE,
    constraint_compile_timeout: float = opts.CONSTRAINT_COMPILE_TIMEOUT,
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", help="The model name clients "
                                                    "send (default: the target path, or 'quickdraft-default')."),
    chat_template: Optional[Path] = typer.Option(None, "--chat-template", help="A jinja chat template file "
                                                 "(for models without one)."),
    dtype: Optional[str] = opts.DTYPE,
    device: Optional[str] = opts.DEVICE,
    compile: Optional[bool] = opts.COMPILE,
    aot: bool = opts.AOT,
    quantization: Optional[str] = opts.QUANTIZATION,
    draft_quantization: Optional[str] = opts.DRAFT_QUANTIZATION,
    draft_dtype: Optional[str] = opts.DRAFT_DTYPE,
    tensor_parallel_size: int = opts.TENSOR_PARALLEL_SIZE,
    tensor_parallel_timeout: float = opts.TENSOR_PARALLEL_TIMEOUT,
    threads: Optional[int] = opts.THREADS,
    replicas: int = typer.Option(1, "--replicas", help="Serve N engine replicas behind Ray Serve's HTTP proxy "
                                 "(needs the ray extra: pip install -e \".[ray]\"); each is a whole engine, "
                                 "tensor-parallel within itself with --tensor-parallel-size."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="QUICKDRAFT_API_KEY", show_envvar=True,
                                          help="Require `Authorization: Bearer KEY` on every /v1/* request "
                                          "(/health and /metrics stay open)."),
    request_timeout: float = typer.Option(30.0, "--request-timeout", help="Seconds a request's headers, then "
                                          "its body, may take to arrive (slow or stalled uploads are closed, "
                                          "or answered 408)."),
    allowed_origins: Optional[str] = typer.Option(None, "--allowed-origins", help="Comma-separated browser "
                                                  "origins allowed to call the API cross-origin (CORS), e.g. "
                                                  "https://app.example.com; none by default."),
    web: bool = typer.Option(True, "--web/--no-web", help="Serve the chat page at / (it shows each token's "
                             "origin: draft, target, prefill; docs/web.md)."),
) -> None:
    """Serve the OpenAI API (completions, chat completions, streaming) with speculative decoding."""
    try:
        import uvicorn

        from ..server.app import ServerState, build_app
        from ..server.connections import uvicorn_config
    except ImportError as exc:
        fail(f"the server needs fastapi, uvicorn and prometheus_client ({exc})")
    if not 0 <= port <= 65535:
        fail(f"--port must be in [0, 65535], got {port}")
    if max_queue < 0:
        fail(f"--max-queue must be >= 0, got {max_queue}")
    template = None
    if chat_template is not None:
        try:
            template = chat_template.read_text()
        except OSError as exc:
            fail(f"cannot read --chat-template {chat_template}: {exc.strerror}")
    if profile is not None and not profile.exists():
        fail(f"--profile {profile} does not exist")
    for spec, flag in ((target, "--target"), (draft, "--draft")):  # fetched while loading; named right now
        if spec is not None and not (flag == "--draft" and spec == SELF_DRAFT):
            try:
                check_spec(spec)
            except QuickdraftError as exc:
                fail(f"{flag}: {exc}")
    options = parse_spec_options(spec_option)
    tp = opts.tensor_parallel_args(tensor_parallel_size, tensor_parallel_timeout)
    caching = tensor_parallel_size == 1 if enable_prefix_caching is None else enable_prefix_caching
    if prefix_cache_check and not caching:
        fail("--prefix-cache-check checks the prefix cache's hits: it needs prefix caching on")
    name = served_model_name or (str(target) if target is not None else "quickdraft-default")

    llm_kwargs = dict(target=target, draft=draft, method=method, num_speculative_tokens=k, dtype=dtype, device=device,
                      max_num_seqs=max_num_seqs, max_model_len=max_model_len, spec_options=options, policy=policy,
                      profile=None if profile is None else str(profile), compile="aot" if aot else compile,
                      quantization=quantization, draft_quantization=draft_quantization, draft_dtype=draft_dtype,
                      preallocate=True, kv_cache_memory=kv_cache_memory, kv_cache_dtype=kv_cache_dtype,
                      max_num_batched_tokens=max_num_batched_tokens,
                      constraint_compile_timeout=constraint_compile_timeout,
                      enable_prefix_caching=caching, prefix_cache_check=prefix_cache_check, **tp)

    def load():
        from ..llm import LLM

        return LLM(**llm_kwargs)

    if replicas != 1:
        if replicas < 1:
            fail(f"--replicas must be >= 1, got {replicas}")
        origins = [o.strip() for o in (allowed_origins or "").split(",") if o.strip()]
        _serve_replicas(llm_kwargs, replicas, host, port, dict(served_model_name=name, max_queue=max_queue,
                                                               api_key=api_key or None, allowed_origins=origins,
                                                               chat_template=template, threads=threads, web=web))
    opts.apply_threads(threads)

    if tp and opts.torchrun_follower():  # torchrun's ranks > 0 serve rank 0's steps, not HTTP
        load()  # returns only through SystemExit once rank 0 is done
        sys.exit(0)

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    if not request_timeout > 0:
        fail(f"--request-timeout must be > 0, got {request_timeout}")
    state = ServerState(load, name, max_queue=max_queue, chat_template=template, request_timeout=request_timeout,
                        freeze_gc=True)
    origins = [o.strip() for o in (allowed_origins or "").split(",") if o.strip()]
    app = build_app(state, api_key=api_key or None, allowed_origins=origins, web=web)
    config = uvicorn_config(app, host, port, log_level, request_timeout)
    server = uvicorn.Server(config)
    shown_host = f"[{host}]" if ":" in host else host

    def ready() -> None:
        engine = state.llm.engine
        page = f"; chat page at http://{shown_host}:{port}/" if web else ""
        print(f"quickdraft: {engine.memory_summary()}", flush=True)
        print(f"quickdraft: serving {name!r} at http://{shown_host}:{port}/v1 "
              f"(method {engine.config.spec.method}, k {engine.k}, max {engine.config.max_num_seqs} running, "
              f"context {engine.max_model_len}){page}; ready", flush=True)

    def load_failed(message: str) -> None:
        server.should_exit = True

    fatal: list[str] = []

    def engine_died(exc: BaseException) -> None:
        if isinstance(exc, EngineFailure):  # e.g. a tensor-parallel rank died: exit, do not answer 503 forever
            fatal.append(str(exc))
            server.should_exit = True

    state.on_ready = ready
    state.on_load_error = load_failed
    state.on_engine_dead = engine_died
    print(f"quickdraft: loading the model; listening on http://{shown_host}:{port} (GET /health is 200 when ready)",
          flush=True)
    server.run()
    if state.load_error is not None:
        fail(state.load_error)
    if fatal:
        print(f"error: the engine failed: {fatal[0]}", file=sys.stderr, flush=True)
        sys.exit(1)
    if not server.started:
        fail(f"could not listen on {host}:{port} (address in use or not available?)")
    sys.exit(0)


def _serve_replicas(llm_kwargs: dict, replicas: int, host: str, port: int, server_options: dict) -> None:
    """`--replicas N`: a local Ray cluster, N engines behind Ray Serve's proxy at host:port."""
    import os
    import signal
    import time

    try:
        import ray
        from ray import serve

        from ..deploy import deployment
    except ImportError as exc:
        fail(f"--replicas needs Ray Serve: pip install -e \".[ray]\" ({exc})")
    app = deployment(llm_kwargs, replicas, **server_options)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # after ray.init (it sets its own): shut Ray down on a kill
    try:
        serve.start(http_options={"host": host, "port": port})
        print(f"quickdraft: starting {replicas} replicas behind Ray Serve at http://{host}:{port}/v1 ...", flush=True)
        try:
            serve.run(app, name="quickdraft", route_prefix="/")
        except Exception as exc:  # noqa: BLE001 - a replica failed to start (its log says why)
            fail(f"the replicas did not start: {exc}")
        print(f"quickdraft: serving {server_options['served_model_name']!r} with {replicas} replicas at "
              f"http://{host}:{port}/v1; ready", flush=True)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    sys.exit(0)
