"""Parity checks: the float64 NumPy oracle, the case matrix, and the comparisons
that prove every backend computes the same function (`python -m parity`)."""
