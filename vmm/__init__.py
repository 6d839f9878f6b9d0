"""VRAM plumbing: the elastic arena, pinned host memory and VRAM monitors. Knows nothing of models."""
