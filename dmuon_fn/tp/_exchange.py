"""Renamed: dmuon_fn/tp/_transfer.py (this alias goes when Muon imports it from there)."""

from ._transfer import TensorExchange as TensorExchange
