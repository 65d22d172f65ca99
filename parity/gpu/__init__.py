"""The GPU kit: `python -m parity.gpu` measures and checks everything that needs a GPU
in one command with a fixed time budget (see __main__.py for what it runs, plan.py for
its time budget, render.py for what it writes)."""
