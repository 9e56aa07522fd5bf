"""What every API's routes share (ServerState): the server's config, the model pool (every local
model on demand, or a pool of one pinned model: both modes run the same code), the admission
count and the metrics. Each API's module takes it in its `router(state)` (app.py mounts them)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..model.vision.fetch import ImageURLPolicy
from .generation import Admission, ServedModel
from .metrics import ServerMetrics
from .openai_schema import APIError
from .pool import ModelPool

if TYPE_CHECKING:  # annotations only: the encoder's module loads torch
    from .encoder_loop import ServedEncoder


@dataclass
class ServerConfig:
    """`localllm serve`'s HTTP options (the engine's are the pool's EngineConfig)."""

    api_key: str | None = None
    cors_origins: list[str] = field(default_factory=list)
    max_queue: int = 256  # requests beyond the engine's batch (EngineConfig.max_num_seqs) that may wait
    max_body_bytes: int = 8 << 20  # larger request bodies get a 413
    bind_host: str = "127.0.0.1"  # the --host it listens on (host_guard: loopback-bound servers check Host)
    allowed_hosts: list[str] = field(default_factory=list)  # --allow-host: more Host names ('*': any)
    image_urls: ImageURLPolicy = field(default_factory=ImageURLPolicy)  # --allow-image-urls and its limits


class ServerState:
    """The context every router is made with (see the module docstring); `acquire` is how a route
    gets the model a request names."""

    def __init__(self, cfg: ServerConfig, pool: ModelPool, log: Callable[[str], None]):
        self.cfg = cfg
        self.pool = pool
        self.log = log
        self.metrics = ServerMetrics()
        self.admission = Admission(pool.cfg.engine_config.max_num_seqs, cfg.max_queue, self.metrics)
        self.aloop: asyncio.AbstractEventLoop | None = None

    def start_loading(self) -> None:
        self.aloop = asyncio.get_running_loop()
        self.pool.start()

    def begin_shutdown(self) -> None:
        """Called from the signal handler: end in-flight requests now so connections close fast."""
        self.admission.closing = True
        if self.aloop is not None:
            self.aloop.call_soon_threadsafe(self.pool.begin_shutdown)

    def require_ready(self) -> None:
        if self.admission.closing:
            raise APIError(503, "the server is shutting down", "service_unavailable", code="server_shutting_down")
        if not self.pool.status()[0]:
            raise APIError(503, "the model is still loading; retry shortly", "service_unavailable",
                           code="model_loading", headers={"Retry-After": "1"})

    async def acquire(self, name: str | None, keep_alive: float | None = None, num_ctx: int | None = None,
                      task: str = "generate") -> tuple[ServedModel | ServedEncoder, Callable[[], None]]:
        """The model a request names, ready to run (loaded first on demand, with `num_ctx` as its
        context when given; a pinned model keeps the server's --ctx), and the callback that ends
        its use."""
        self.require_ready()
        return await self.pool.acquire(name, keep_alive, num_ctx, task)
