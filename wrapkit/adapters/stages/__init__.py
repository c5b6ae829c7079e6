"""Pipeline stages around another kind's parts, shared by the pipeline and Megatron adapters and read by the
operations: the plan of which stage owns each tensor, and the whole model rebuilt from every stage."""
