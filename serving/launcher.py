"""`kimi-linear-jax serve`: the server's app (`serving/server.py`) under uvicorn, with the
connection timeouts uvicorn lacks (`serving/connections.py`) and a drain on SIGINT / SIGTERM."""

from __future__ import annotations

import os

import uvicorn

from serving.connections import TimedH11Protocol
from serving.engine import LLM
from serving.server import DEFAULT_MODEL_NAME, OpenAIServer, build_app

# Bound on a graceful shutdown: running requests get this long (the first DRAIN_S of it to
# finish by themselves, `OpenAIServer.begin_drain`), then are cancelled.
SHUTDOWN_GRACE_S = 5


def model_name_for(path: str | None, served_name: str | None = None) -> str:
    """--served-model-name, else the checkpoint's directory name, else the default's name."""
    if served_name:
        return served_name
    if path:
        return os.path.basename(os.path.normpath(path))
    return DEFAULT_MODEL_NAME


def serve(
    llm: LLM,
    host: str = "127.0.0.1",
    port: int = 8000,
    timeout_keep_alive: float = 5.0,
    **kwargs,
) -> None:
    """Serve until interrupted (the `kimi-linear-jax serve` command). An idle connection closes
    after `timeout_keep_alive` seconds (uvicorn's default, 5): a proxy that keeps connections
    longer than the server may reuse one just as it closes, and its client sees a reset."""
    app = build_app(llm, **kwargs)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=TimedH11Protocol,  # idle and header-phase connections close too
        log_level="info",
        timeout_keep_alive=timeout_keep_alive,
        # SIGINT / SIGTERM: stop accepting, give running requests this long, then cancel them
        # (their handlers abort them in the engine) and stop the engine loop.
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    try:
        DrainingServer(config, app.state.server).run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled; uvicorn.run does this
        pass


class DrainingServer(uvicorn.Server):
    """uvicorn's server that tells the app a shutdown began (`begin_drain`) when the signal
    comes, so that its streams end with an error event and [DONE] inside the grace period
    instead of being cut."""

    def __init__(self, config: uvicorn.Config, server: OpenAIServer) -> None:
        super().__init__(config)
        self.app_server = server

    def handle_exit(self, sig, frame) -> None:
        self.app_server.begin_drain()
        super().handle_exit(sig, frame)
