"""Reading, describing and writing Kimi K2 checkpoints (safetensors shards + config)."""
