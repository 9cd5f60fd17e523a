"""Gemma 4 target and assistant model code, configs, checkpoint import and synthetic presets."""
