"""The Triton kernels compiled ahead of time and read without a GPU
(`python -m parity.compiled`, bridge/SPEC.md "Compiled, not run"):

- `build.py`: one launch compiled for a CUDA arch as a real launch is specialised;
  ptxas's registers, spills and shared memory; tensor-core instructions in the PTX; the
  roofline lower bound; the variants every kernel is built at.
- `symbolic.py`, `tripcounts.py`: how often each loop of a kernel runs, per program,
  from its own control flow run on stand-in values.
- `sass.py`: the SASS of a cubin: instruction classes, loops, occupancy, a dynamic
  warp-instruction estimate, each program's dependent chain.
- `timemodel.py`: a time per launch from those figures (HBM, tensor, MUFU, issue and
  dependent-chain terms) on an H100 and an H200.
- `fla.py`: flash-linear-attention's GLA chunk kernels compiled the same way (fla-core).
- `report.py`: one call's report and its markdown (BENCHMARKS.md, "GPU readiness").
- `__main__.py`: the command line.
"""
