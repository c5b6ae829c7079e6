"""Weights handed on while training runs: ``copy_to`` (sync and EMA), ``stream_full_parameters``, ``gathered`` and
``generation`` at unsharded speed, and ``sleep`` / ``wake`` beside a colocated engine."""
