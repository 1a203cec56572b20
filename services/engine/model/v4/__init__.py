"""DeepSeek-V4 (V4-Flash, -Base: ``model_type`` deepseek_v4): mHC residual streams, sliding-window
attention with CSA/HCA compressed entries, hash-routed first MoE layers. ``config``
(V4ModelConfig), ``layers``, ``checkpoint_names``, ``model``, and its own ``compressors`` and
``kv_cache`` (the paged groups and per-request state rings)."""
