"""The step's math: `Config` (one set of hyperparameter names), the pure per-parameter
updates both faces call, and the gradient guard."""
