"""The model families Ferry runs, by config.json's ``model_type``: one entry each, naming its
config class and its package (``v3/``, ``v4/`` ...). Every package has the same modules:
``config`` (the config class), ``layers``, ``model`` (the ``MoECausalLM``) and
``checkpoint_names`` (what the loader asks of it: see ``CheckpointNames``). Adding a family is its
package and one entry here.

No torch: the CLI and the simulator read configs and presets through this. A family's ``model``
and ``checkpoint_names`` are imported when the loader first asks for them.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from ferry.services.engine.model.config import ConfigError
from ferry.services.engine.model.v3.config import ModelConfig
from ferry.services.engine.model.v4.config import V4ModelConfig
from ferry.services.engine.model.v41.config import V41ModelConfig

if TYPE_CHECKING:
    import torch

    from ferry.services.engine.model.causal_lm import MoECausalLM

AnyModelConfig = ModelConfig | V4ModelConfig | V41ModelConfig


class CheckpointNames(Protocol):
    """A family's ``checkpoint_names`` module: its checkpoints' tensors, by Ferry's names
    (transformers' module names, the routed experts one tensor per expert:
    ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``)."""

    def checkpoint_shapes(self, c: Any) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint for ``c`` must hold, by Ferry's name."""
        ...

    def is_ignored(self, name: str, c: Any) -> bool:
        """A stored tensor Ferry does not load (MTP layers, rotary caches)."""
        ...

    def ferry_tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """A stored tensor as Ferry's: renamed, or split into several."""
        ...

    def stored_name(self, name: str) -> str:
        """The name the family's published checkpoints give one of Ferry's tensors."""
        ...

    def fp8_block(self, name: str, c: Any) -> tuple[int, int]:
        """The [rows, cols] block of one scale of the stored FP8 tensor ``name``."""
        ...


@dataclass(frozen=True)
class Family:
    """One model family: its config class (which knows its ``model_type``), and its package's
    model class and checkpoint names, imported on first use (they need torch)."""

    config_class: type[AnyModelConfig]
    package: str  # its package under ferry.services.engine.model: v3, v4 ...
    model_class_name: str  # in the package's model.py

    @property
    def model_type(self) -> str:
        return self.config_class.model_type

    def model_class(self) -> type[MoECausalLM]:
        module = importlib.import_module(f"{__package__}.{self.package}.model")
        model_class: type[MoECausalLM] = getattr(module, self.model_class_name)
        return model_class

    def checkpoint_names(self) -> CheckpointNames:
        module = importlib.import_module(f"{__package__}.{self.package}.checkpoint_names")
        return cast("CheckpointNames", module)


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family(ModelConfig, "v3", "DeepseekV3ForCausalLM"),
        Family(V4ModelConfig, "v4", "DeepseekV4ForCausalLM"),
        Family(V41ModelConfig, "v41", "DeepseekV41ForCausalLM"),
    )
}


def family_of(config: AnyModelConfig) -> Family:
    return FAMILIES[config.model_type]


def config_from_hf_dict(d: dict[str, Any], source: str = "config.json") -> AnyModelConfig:
    """The config of any model Ferry runs, read by its family's class (by ``model_type``)."""
    model_type = d.get("model_type")
    if model_type is None and V41ModelConfig.is_reference_form(d):
        model_type = V41ModelConfig.model_type  # DeepSeek's flat inference/config.json
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        runs = ", ".join(repr(t) for t in FAMILIES)
        raise ConfigError(f"{source}: unsupported model_type {model_type!r}; Ferry runs {runs}")
    return family.config_class.from_hf_dict(d, source)
