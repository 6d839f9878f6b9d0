"""VRAM plumbing: the elastic arena, pinned host memory, VRAM monitors. Knows no models."""
