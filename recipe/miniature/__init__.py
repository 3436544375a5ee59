"""Miniature reproduction of MemAgent's length-extrapolation result (SmolLM2-135M, train <= 8 chunks)."""
