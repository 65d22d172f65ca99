"""Benchmark of gla-bridge's backends against external anchors: `python -m parity.bench`.

Modules, one idea each: `flops` (the FLOP count), `anchors` (every compared CPU
implementation behind one interface), `verify` (each one checked against the
oracle before it is timed), `timing` (time, peak memory, machine ceilings),
`runner` (the sweep over shapes and T with budgets), `gpu` (the GPU section),
`report` (BENCHMARKS.md tables, JSON, PNG plots).
"""
