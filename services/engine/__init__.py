"""The engine both workers run: paged MLA KV cache, step planner, sampler, model."""

from ferry.services.engine.async_engine import AsyncEngine
from ferry.services.engine.config import EngineConfig
from ferry.services.engine.engine import Engine
from ferry.services.engine.request import RequestOutput
from ferry.services.engine.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
