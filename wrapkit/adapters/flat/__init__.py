"""FSDP1's storage kind: flat parameters (``FlatParameter``), the FSDP adapter and its parts."""
