"""Attention backends: torch-native (CPU and reference), Triton, FlashInfer."""
