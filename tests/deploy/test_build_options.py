"""`serve run quickdraft.deploy:build ... api_key=K allowed_origins=...`: the server's options go
to each replica's app, not to LLM() (which rejects them, so such a replica never started).
The replica class is run here in this process (its engine and its FastAPI app, the code each
Ray Serve replica runs); tests/deploy/test_ray_replicas.py serves two replicas with a key on a local
Ray cluster."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve")

from quickdraft.deploy import build  # noqa: E402


def _replica(args: dict):
    """The replica `build(args)` deploys, constructed as Ray Serve would (without Ray's wrapper)."""
    bound = build(args)._bound_deployment
    cls = bound.func_or_class.__mro__[1]  # serve.ingress's wrapper subclasses QuickdraftReplica
    return cls(*bound.init_args, **bound.init_kwargs)


def test_build_routes_api_key_and_origins_to_the_server():
    import httpx

    replica = _replica({"replicas": "1", "api_key": "123", "allowed_origins": "https://a.example, https://b.example",
                        "served_model_name": "7", "method": "ngram", "compile": "false", "max_num_seqs": "2"})
    try:
        app = replica.__serve_build_asgi_app__()

        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                body = {"model": "7", "prompt": "def f(", "max_tokens": 2}
                without = await c.post("/v1/completions", json=body)
                wrong = await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer 12"})
                models = await c.get("/v1/models", headers={"Authorization": "Bearer 123",
                                                            "Origin": "https://b.example"})
                return without, wrong, models

        without, wrong, models = asyncio.run(go())
        assert without.status_code == 401 and wrong.status_code == 401
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "7"  # the key kept as text
        assert models.headers.get("access-control-allow-origin") == "https://b.example"
    finally:
        replica.llm.close()


def test_build_reads_the_chat_template_file(tmp_path):
    from quickdraft import QuickdraftError

    with pytest.raises(QuickdraftError, match="cannot read chat_template"):
        build({"replicas": "1", "chat_template": str(tmp_path / "missing.jinja")})
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    bound = build({"replicas": "1", "chat_template": str(template), "method": "ngram"})._bound_deployment
    assert bound.init_args[0] == {"method": "ngram"}  # LLM's arguments only
    assert bound.init_args[-2:] == ("{{ messages[0]['content'] }}", True)  # chat_template, web
