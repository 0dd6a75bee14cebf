"""Training state on the parameter servers: optimizers, metrics, checkpoints."""
