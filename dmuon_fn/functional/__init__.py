"""The functional API: `plan`, `init`, `value_and_grad`, `update` (one compiled step), staged Z3."""
