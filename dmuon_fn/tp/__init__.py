"""Tensor parallelism: how a dedicated parameter lies over the tensor ranks, and the step's
exchange that orthogonalizes each matrix once."""
