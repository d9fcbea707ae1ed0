"""The OpenAI-compatible server (FastAPI over the engine thread) and its load generator."""
