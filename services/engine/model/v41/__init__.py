"""DeepSeek-V4.1 (model_type deepseek_v41)."""
