"""The engine side of the integrations: the wire to an engine in another process (its HTTP routes with timeouts,
the agreed outcome), vLLM's dense and sparse transfers and its trainer-side weight source, LoRA adapters to
engines, and the transfer backend wrapkit gives vLLM's own server (``vllm_gloo``). ``integrations.vllm`` and
``integrations.sglang`` are the public entry points."""
