"""Reference models and placement: ``prepare_reference`` (fresh frozen copies, sharded like the policy), the PEFT
view with its adapters off, and ``place`` / ``to_eval_frozen``."""
