"""The running OpenAI-compatible server: FastAPI routes over the engine's own thread. Its load
generator is `quickdraft.bench.serve_load`; the command that starts it, `quickdraft.cli.serve`."""
