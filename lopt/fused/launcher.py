"""Kernel launch plumbing shared by every fused optimizer (placeholder until the kernels land)."""

from __future__ import annotations

FUSED_ARCHITECTURES: tuple = ()


def fused_unavailable_reason(architecture: str, devices) -> str | None:
    """None if the fused backend can run ``architecture`` on ``devices``, else why not."""
    if architecture not in FUSED_ARCHITECTURES:
        return f"lopt has no fused kernels for {architecture} yet"
    return None
