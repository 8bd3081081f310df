"""model.safetensors.index.json from the shards a folder holds: the index Hugging Face loaders and openk3's own
(model/weights.py checkpoint_files) read to find which file holds each tensor.

The index is derived, never edited by hand: `write_index(folder)` reads the tensor names (and byte sizes) of every
`*.safetensors` file in the folder and writes the map, so after a shard changes (new tensors, a new shard such as the
demo model's `model-mtp.safetensors`) it is regenerated with

  python -m openk3.model.shard_index openk3/assets/tiny
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors import safe_open

INDEX = "model.safetensors.index.json"


def shard_index(folder: Path) -> dict:
    """{"metadata": {"total_size": bytes}, "weight_map": tensor name -> shard file name} over every shard in `folder`;
    a tensor name in two shards is an error naming both."""
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{folder}: no *.safetensors shards to index")
    weight_map: dict[str, str] = {}
    total = 0
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                if name in weight_map:
                    raise ValueError(f"{folder}: tensor {name} is in both {weight_map[name]} and {shard.name}")
                weight_map[name] = shard.name
                piece = f.get_slice(name)
                numel = 1
                for d in piece.get_shape():
                    numel *= d
                total += numel * _dtype_bytes(piece.get_dtype())
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def _dtype_bytes(dtype: str) -> int:
    sizes = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "BOOL": 1}
    if dtype not in sizes:
        raise ValueError(f"safetensors dtype {dtype!r}: expected one of {sorted(sizes)}")
    return sizes[dtype]


def write_index(folder: str | Path) -> Path:
    """Write `folder`/model.safetensors.index.json over every shard in the folder; returns its path."""
    folder = Path(folder)
    path = folder / INDEX
    path.write_text(json.dumps(shard_index(folder), indent=2) + "\n")
    return path


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["."]:
        print(write_index(arg))
