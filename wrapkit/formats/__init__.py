"""The formats wrapkit reads and writes, below every operation and backend: the Hub's layout of a model's
tensors (``hub``) and Megatron-Core's (``megatron``), safetensors files (``safetensors``), torch's distributed
checkpoint boxes (``dcp``) and the atomic commit of a directory (``directory``).

A format imports no operation and no backend. These modules are internal: their names may change between
releases; the public API is ``wrapkit``'s own."""
