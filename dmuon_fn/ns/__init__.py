"""Newton-Schulz: coefficients, the iteration, its cost, the device dispatch, orthogonalize."""
