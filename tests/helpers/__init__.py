"""Helpers the test modules share (no test module imports another): README and docs blocks, TensorBoard
event files, variables for tests, waiting."""
