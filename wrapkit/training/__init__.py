"""Training state: ``save_state`` / ``load_state`` (weights, optimizer, scheduler and RNG in torch's distributed
checkpoint), what this rank holds of it, and the optimizers inside containers."""
