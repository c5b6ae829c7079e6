"""Weights in and out through files and state dicts: ``save_pretrained`` and ``load`` in the Hub's layout, the
adapters alone in PEFT's, one-file checkpoints, and ``full_state_dict`` / ``load_full_state_dict``."""
