"""Training parity: one small GLA language model trained in PyTorch and in JAX from the
same weights on the same batches, compared after every step (`python -m parity.train`).

Modules, one idea each: `data` (the text and the batch order, NumPy), `optim` (one AdamW
written for torch.optim and optax), `state` (the optimizer state's safetensors file),
`trainer_torch` / `trainer_jax` (one framework's model and optimizer, stepped),
`lockstep` (both stepped together and compared; the checkpoint round trip), `report`
(the plot and BENCHMARKS.md's "Training parity" section), `__main__` (the command).
"""
