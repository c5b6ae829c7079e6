"""Megatron-Core's storage kind: tensor-parallel slices in plain tensors, the Megatron adapter and its parts.
The Hub mapping of its fused layers is a format (``formats/megatron.py``)."""
