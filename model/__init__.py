"""The Gemma 4 body (target and assistant), its primitives, caches and static methods, configs,
float checkpoints and synthetic presets."""
