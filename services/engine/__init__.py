"""The engine both workers run: paged MLA KV cache, step planner, sampler, model."""

from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.request import RequestOutput
from services.engine.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
