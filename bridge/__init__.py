"""The framework-neutral core of gla-bridge: the contract, the dispatch, the launch plans
and the Triton kernels that `torch_side` and `jax_side` both call (the contract itself is
bridge/SPEC.md): what a call runs, nothing else (the analysis of the compiled kernels is
`parity.compiled`). Arrows point into this package, never out of it.

Framework-neutral: importing these needs neither torch nor JAX (NumPy, and Triton for the
kernels). Those marked * import a framework inside one function, only when handed its
objects or asked for its kernels.

- `contract.py`*: the vocabulary (input names, which have a time axis, which are per
  sequence), the argument checks and the frozen `Plan` with its tensors' shapes, dtypes
  and bytes (torch: offsets checked on the device).
- `decay.py`: the key decay `g + gk + g_gamma` on whole arrays of any framework.
- `dispatch.py`: the steps of every call around the launch (prepare, route, layouts).
- `variants.py`: what the named variants of both frameworks share (ejkernel's aliases, the
  Lightning decay, argument rules).
- `context.py`: the framework-neutral steps of context parallelism and its vocabulary.
- `grads.py`: gradients from a backward launch list's buffers.
- `launch.py`: the `Launch` records of a launch list, bound by kernel parameter name.
- `tuning.py`*: launch configs by device, the table (`tuning.json`) whose entries the
  launch plans take as their defaults (the device named by torch or JAX, whichever is
  loaded, only when asked for a launch list).
- `kernels/`: the Triton kernels and their launch plans (`__init__.py`* asks torch whether
  a GPU is there, to choose Triton's interpreter; `interpreter.py` patches it).
- `weights.py`*: the layer configuration; weight transfer torch <-> JAX.
- `model_config.py`, `checkpoint.py`: the language model's configuration (a transformers
  `PreTrainedConfig`, shared by both frameworks; transformers itself imports torch where
  torch is installed) and its checkpoints (safetensors, NumPy).

Framework-bound: importing these imports a framework.

- `torch_runner.py` (torch): runs launch lists on torch tensors, for the PyTorch ops and
  for JAX's CPU host callback.

tests/test_lint.py holds this list to the files and their imports.
"""
