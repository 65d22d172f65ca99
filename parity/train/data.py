"""The training text and the batch order, framework-neutral (NumPy).

The text is parity/data/spec.txt (see parity/data/README.md), read as bytes: a token is
a byte, so the vocabulary is 256. The batch order is drawn once from one seed: batch s
is `B` windows of `T` consecutive bytes at offsets drawn uniformly, the same int32
array handed to every framework.
"""

import hashlib
import os

import numpy as np

CORPUS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                      "spec.txt")
VOCAB = 256


def corpus(path: str = CORPUS) -> np.ndarray:
    """The text's bytes as uint8 [n]."""
    with open(path, "rb") as f:
        return np.frombuffer(f.read(), np.uint8)


def digest(data: np.ndarray) -> str:
    """The first 16 hex digits of the text's sha256 (recorded with every run)."""
    return hashlib.sha256(data.tobytes()).hexdigest()[:16]


def batches(data: np.ndarray, steps: int, batch: int, seq: int, seed: int) -> np.ndarray:
    """int32 [steps, batch, seq]: windows of `data` at offsets from
    np.random.default_rng(seed)."""
    for name, v in (("steps", steps), ("batch", batch), ("seq", seq)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    if seq > len(data):
        raise ValueError(f"seq: {seq} is longer than the text ({len(data)} bytes)")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(data) - seq + 1, size=(steps, batch))
    return data[starts[..., None] + np.arange(seq)].astype(np.int32)
