"""The engine both workers run: paged MLA KV cache, step planner, sampler, model. Importing the
package loads none of its modules (names resolve when first used), so that torch-free code (the
CLI) can read ``config`` and the model's ``presets``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ferry.services.common.lazy import lazy_exports

if TYPE_CHECKING:
    from ferry.services.common.sampling_params import SamplingParams
    from ferry.services.engine.async_engine import AsyncEngine
    from ferry.services.engine.config import EngineConfig
    from ferry.services.engine.engine import Engine
    from ferry.services.engine.request import RequestOutput

_EXPORTS = {
    "AsyncEngine": "ferry.services.engine.async_engine",
    "Engine": "ferry.services.engine.engine",
    "EngineConfig": "ferry.services.engine.config",
    "RequestOutput": "ferry.services.engine.request",
    "SamplingParams": "ferry.services.common.sampling_params",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
]
