"""Checkpoint loading: HF safetensors directories and GGUF files."""
