"""The step's math: `Config`, the pure per-parameter updates of both faces, the gradient guard."""
