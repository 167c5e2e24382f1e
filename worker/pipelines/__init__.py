"""Diffusers pipelines as kiln holds them: families, loading, switches, quantization, compile,
adapters, the resident and RAM caches, weights on disk, and the tiny random-weight builders."""
