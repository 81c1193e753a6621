"""What a data-parallel router asks of a replica server beyond SGLang's routes:
`GET /lmnb/cache_events?since=N`, the prefix cache's evictions after event N
(`Runtime.cache_events`), so that the router's meta tree forgets what the replica forgot."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, runtime_checkable

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from lmnb.server.errors import error_body
from lmnb.server.streams import ServedRuntime


@runtime_checkable
class CacheEventSource(Protocol):
    """A runtime whose prefix cache reports its events (`Runtime`; not a data-parallel one)."""

    def cache_events(self, since: int) -> dict[str, Any]: ...


def make_router(runtime: ServedRuntime, model_name: str) -> APIRouter:
    router = APIRouter()

    @router.get("/lmnb/cache_events", response_model=None)
    async def cache_events(since: int = 0) -> Any:
        if not isinstance(runtime, CacheEventSource):
            return JSONResponse(error_body("this runtime reports no cache events",
                                           type="not_found_error"), status_code=404)
        return await asyncio.to_thread(runtime.cache_events, since)

    return router
