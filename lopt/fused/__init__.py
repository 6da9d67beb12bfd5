"""Fused CUDA backends: a shared launcher (compile cache, stream, pointer tables) and one module per optimizer."""
