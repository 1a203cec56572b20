"""DeepSeek-V3 (and R1, V3.1: ``model_type`` deepseek_v3): MLA over a paged latent cache, group-limited
DeepSeekMoE. ``config`` (ModelConfig), ``layers``, ``checkpoint_names``, ``model``."""
