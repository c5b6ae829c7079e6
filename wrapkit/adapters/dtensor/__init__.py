"""The DTensor storage kind: FSDP2 and tensor parallelism, their parts, and the layout of a DTensor of any
placement on any mesh."""
