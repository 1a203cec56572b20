"""The DeepSeek-V3 and -V4 model runtime: ``load_model`` and ``prompt_logits`` (``api``) are the public
entry points. One package per model family (``v3/``, ``v4/``: config, layers, checkpoint_names,
model), beside what they share (cache_spec, rope, forward_batch, moe, causal_lm, loader,
presets); ``registry`` maps a config's ``model_type`` to its family. Importing the package loads
none of its modules (names resolve when first used), so that torch-free code can read the
configs and ``presets``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ferry.services.common.lazy import lazy_exports

if TYPE_CHECKING:
    from ferry.services.engine.experts import ExpertPlacement
    from ferry.services.engine.model.api import load_model, model_config, prompt_logits
    from ferry.services.engine.model.causal_lm import MoECausalLM
    from ferry.services.engine.model.config import ConfigError, RopeScaling
    from ferry.services.engine.model.forward_batch import AttentionPath, ForwardBatch
    from ferry.services.engine.model.loader import LoaderError, export_preset
    from ferry.services.engine.model.presets import PRESETS
    from ferry.services.engine.model.v3.config import ModelConfig
    from ferry.services.engine.model.v3.model import DeepseekV3ForCausalLM
    from ferry.services.engine.model.v4.config import V4ModelConfig
    from ferry.services.engine.model.v4.model import DeepseekV4ForCausalLM

_EXPORTS = {
    "PRESETS": "ferry.services.engine.model.presets",
    "AttentionPath": "ferry.services.engine.model.forward_batch",
    "ConfigError": "ferry.services.engine.model.config",
    "DeepseekV3ForCausalLM": "ferry.services.engine.model.v3.model",
    "DeepseekV4ForCausalLM": "ferry.services.engine.model.v4.model",
    "MoECausalLM": "ferry.services.engine.model.causal_lm",
    "V4ModelConfig": "ferry.services.engine.model.v4.config",
    "ExpertPlacement": "ferry.services.engine.experts",
    "ForwardBatch": "ferry.services.engine.model.forward_batch",
    "LoaderError": "ferry.services.engine.model.loader",
    "ModelConfig": "ferry.services.engine.model.v3.config",
    "RopeScaling": "ferry.services.engine.model.config",
    "export_preset": "ferry.services.engine.model.loader",
    "load_model": "ferry.services.engine.model.api",
    "model_config": "ferry.services.engine.model.api",
    "prompt_logits": "ferry.services.engine.model.api",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "PRESETS",
    "AttentionPath",
    "ConfigError",
    "DeepseekV3ForCausalLM",
    "DeepseekV4ForCausalLM",
    "ExpertPlacement",
    "ForwardBatch",
    "LoaderError",
    "MoECausalLM",
    "ModelConfig",
    "RopeScaling",
    "V4ModelConfig",
    "export_preset",
    "load_model",
    "model_config",
    "prompt_logits",
]
