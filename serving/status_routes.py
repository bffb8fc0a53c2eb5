"""The server's plain endpoints: GET /v1/models and /v1/models/{id} (this server's one model),
GET /health (liveness and readiness) and GET /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest


def add_status_routes(app: FastAPI, server) -> None:
    """Register the endpoints on `app`, over the `OpenAIServer` `server`."""

    def card() -> dict:
        card = {"id": server.model_name, "object": "model", "created": 0}
        return card | dict(owned_by="kimi-linear-jax", max_model_len=server.llm.max_model_len)

    async def models() -> dict:
        return {"object": "list", "data": [card()]}

    async def model(model_id: str) -> dict:
        """OpenAI's retrieve-model: this server's card, or 404 naming the one it has."""
        server._check_model(model_id)
        return card()

    async def health() -> Response:
        return health_response(server)

    async def prometheus() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type="text/plain")

    app.get("/v1/models")(models)
    app.get("/v1/models/{model_id:path}")(model)
    app.get("/health")(health)
    app.get("/metrics")(prometheus)


def health_response(server) -> JSONResponse:
    """503 when the engine cannot step: its thread stopped, or a step fault it could not
    recover from; 503 "warming up" until the warm-up request has run. A fault it recovered
    from (the step's requests failed alone) is shown as `last_error` with status ok."""
    engine = server.engine
    if not engine.alive:
        body = {"status": "engine loop stopped"}
        if engine.broken is not None:  # across processes a fault ends the loop
            body["error"] = engine.broken
        return JSONResponse(body, status_code=503)
    if engine.broken is not None:
        body = {"status": "engine cannot step", "error": engine.broken}
        return JSONResponse(body, status_code=503)
    if not server.ready:  # a load balancer should not send traffic into the first compile
        return JSONResponse({"status": "warming up"}, status_code=503)
    body = {"status": "ok"}
    if server.llm.last_error is not None:
        body["last_error"] = server.llm.last_error
    return JSONResponse(body)
