"""Tensor parallelism: a dedicated parameter's layout over the tensor ranks, the step's exchange."""
