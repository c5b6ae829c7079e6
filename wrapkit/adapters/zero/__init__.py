"""DeepSpeed's storage kind: ZeRO stages 0-3, the engine's adapter, its partitions, its reference, its resume
and its states (sleep)."""
