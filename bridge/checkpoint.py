"""GLA model checkpoints on transformers' directory layout, framework-neutral.

    <dir>/config.json                          GLAConfig.to_json(): every field and "dtype"
    <dir>/model.safetensors                    every parameter, by fla's names
  or, sharded:
    <dir>/model.safetensors.index.json         {"metadata": {"total_size", "total_parameters"},
                                                "weight_map": {name: shard file}}
    <dir>/model-00001-of-0000N.safetensors ...

Arrays are NumPy arrays, read and written by the safetensors library (never pickle), so
JAX loads with no torch; bfloat16 is `ml_dtypes.bfloat16` (NumPy has none; ml_dtypes comes
with jax and the `models` extra). Files carry safetensors metadata {"format": "pt"}, which
transformers asks of the files it loads (the layout is torch's: Linear weights [out, in]).
Names and shapes are checked strictly against bridge.model_config.model_param_shapes:
a missing, unexpected or misshapen parameter is a ValueError listing them.
"""

import json
import os
import re

from .model_config import GLAConfig, model_param_shapes

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = ("float16", "bfloat16", "float32", "float64")
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30}


def _numpy():
    import ml_dtypes  # noqa: F401  (registers NumPy's "bfloat16" for safetensors)
    import numpy as np

    return np


def check_model_params(params, config: GLAConfig, argname: str = "params") -> None:
    """ValueError unless `params` ({name: array}) has exactly the names, shapes and a
    floating dtype (DTYPES) that `config` asks for; every problem listed at once."""
    if not isinstance(params, dict):
        raise TypeError(f"{argname}: expected a dict of arrays, got {type(params).__name__}")
    want = model_param_shapes(config)
    missing, extra = sorted(set(want) - set(params)), sorted(set(params) - set(want))
    shapes = [f"{n}: expected {want[n]}, got {tuple(params[n].shape)}" for n in want
              if n in params and tuple(params[n].shape) != want[n]]
    dtypes = [f"{n}: {params[n].dtype}" for n in want
              if n in params and str(params[n].dtype).replace("torch.", "") not in DTYPES]
    if missing or extra or shapes or dtypes:
        raise ValueError(
            f"{argname}: the parameters do not fit the config: missing {missing}, unexpected "
            f"{extra}, wrong shapes {shapes}, non-float dtypes {dtypes} (expected floating "
            f"dtypes {DTYPES}); config {config}")


def _shard_bytes(max_shard_size):
    if max_shard_size is None or (isinstance(max_shard_size, int)
                                  and not isinstance(max_shard_size, bool)):
        if max_shard_size is not None and max_shard_size < 1:
            raise ValueError(f"max_shard_size: expected a positive size, got {max_shard_size}")
        return max_shard_size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)\s*", str(max_shard_size).upper())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"max_shard_size: expected bytes (int) or a size such as '5GB', "
                         f"'500MiB', got {max_shard_size!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _clear(directory):
    """Remove the weight files an earlier save left (a sharded save after a single-file
    one must not leave both behind)."""
    for name in os.listdir(directory):
        if name in (WEIGHTS, INDEX) or _SHARD.fullmatch(name):
            os.remove(os.path.join(directory, name))


def write_weights(directory, params: dict, max_shard_size=None) -> list:
    """Write `params` ({name: NumPy array}) as model.safetensors, or as shards of at most
    `max_shard_size` (bytes, or '5GB' / '500MiB' like transformers; a larger tensor gets
    a shard of its own) with the index. Returns the files written. Unchecked names."""
    from safetensors.numpy import save_file

    np = _numpy()
    limit = _shard_bytes(max_shard_size)
    arrays = {n: np.ascontiguousarray(a) for n, a in params.items()}
    os.makedirs(directory, exist_ok=True)
    _clear(directory)
    meta = {"format": "pt"}
    total = sum(a.nbytes for a in arrays.values())
    if limit is None or total <= limit:
        save_file(arrays, os.path.join(directory, WEIGHTS), metadata=meta)
        return [WEIGHTS]
    shards, size = [{}], 0
    for name, a in arrays.items():
        if shards[-1] and size + a.nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = a
        size += a.nbytes
    files, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, fname), metadata=meta)
        files.append(fname)
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_parameters": sum(a.size for a in arrays.values()),
                          "total_size": total},
             "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(directory, INDEX), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    return files + [INDEX]


def read_weights(directory) -> dict:
    """{name: NumPy array} from model.safetensors or the sharded index (unchecked names;
    an index and its shards must agree key for key). ValueError when there is no
    safetensors checkpoint (pickled .bin / .pt files are never read)."""
    from safetensors import safe_open

    np = _numpy()  # noqa: F841  (bfloat16 must be registered before reading)
    directory = os.fspath(directory)
    single, index = (os.path.join(directory, n) for n in (WEIGHTS, INDEX))
    if os.path.isfile(single) and os.path.isfile(index):
        raise ValueError(f"directory: both {WEIGHTS} and {INDEX} in {directory}; "
                         f"remove the stale one")
    if os.path.isfile(single):
        files = {WEIGHTS: None}
    elif os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"directory: {index} has no weight_map")
        files = {}
        for name, fname in weight_map.items():
            files.setdefault(fname, set()).add(name)
    else:
        found = sorted(os.listdir(directory)) if os.path.isdir(directory) else "no directory"
        raise ValueError(f"directory: no {WEIGHTS} or {INDEX} in {directory} (found "
                         f"{found}); only safetensors checkpoints load")
    out = {}
    for fname, listed in files.items():
        path = os.path.join(directory, fname)
        if os.path.basename(fname) != fname or not os.path.isfile(path):
            raise ValueError(f"directory: the index names the shard {fname!r}, not a file "
                             f"in {directory}")
        with safe_open(path, framework="np") as f:
            keys = set(f.keys())
            if listed is not None and keys != listed:
                raise ValueError(f"directory: {fname} holds {sorted(keys - listed)} beyond "
                                 f"its index entries and lacks {sorted(listed - keys)}")
            twice = sorted(keys & set(out))
            if twice:
                raise ValueError(f"directory: {twice} stored in more than one file")
            out.update({k: f.get_tensor(k) for k in keys})
    return out


def save_pretrained(directory, config: GLAConfig, params: dict, *, max_shard_size=None):
    """Write config.json and the weights (`params`: {name: NumPy array}, names and shapes
    of model_param_shapes(config), checked first). config.json's "dtype" is the
    parameters' dtype when they share one."""
    if not isinstance(config, GLAConfig):
        raise TypeError(f"config: expected a GLAConfig, got {type(config).__name__}")
    check_model_params(params, config)
    dtypes = {str(a.dtype).replace("torch.", "") for a in params.values()}
    os.makedirs(directory, exist_ok=True)
    write_weights(directory, params, max_shard_size)
    text = json.loads(config.to_json())
    text["dtype"] = dtypes.pop() if len(dtypes) == 1 else None
    with open(os.path.join(directory, CONFIG), "w", encoding="utf-8") as f:
        json.dump(text, f, indent=2, sort_keys=True)
        f.write("\n")


def read_config(directory) -> GLAConfig:
    """The GLAConfig of `directory`/config.json (either fla-hub spelling), or a
    ValueError naming the directory when there is none."""
    path = os.path.join(os.fspath(directory), CONFIG)
    if not os.path.isfile(path):
        raise ValueError(f"path: no {CONFIG} at {path}")
    with open(path, encoding="utf-8") as f:
        return GLAConfig.from_dict(json.load(f))


def load_pretrained(directory) -> tuple:
    """(GLAConfig, {name: NumPy array}) from a directory fla or we wrote, checked
    strictly against the config (check_model_params)."""
    config = read_config(directory)
    params = read_weights(directory)
    check_model_params(params, config, argname=f"checkpoint {os.fspath(directory)}")
    return config, params
