"""Where a checkpoint's tensors come from: a `TensorSource` lists them and reads them, or slices of them.

The loader (engine/weights.py) sees only this interface, so a second checkpoint format is one more
class here, not a second loader. Today's source is safetensors (one file, or shards with an index);
a GGUF file is meant to be the second (`open_source` is where it will be picked), with its own
tensor names mapped onto the same specs (engine/tensor_specs.py).
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from engine.errors import ModelLoadError


@dataclass(frozen=True)
class TensorSlice:
    """Indices [start, end) along dimension `dim` (0: rows, 1: columns) of a tensor; the others whole."""

    dim: int
    start: int
    end: int

    def __post_init__(self) -> None:
        if self.dim not in (0, 1) or not 0 <= self.start <= self.end:
            raise ValueError(f"TensorSlice(dim={self.dim}, start={self.start}, end={self.end}) is invalid: "
                             "dim must be 0 or 1 and 0 <= start <= end")

    def shape_of(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape this slice of a tensor of `shape` has."""
        out = list(shape)
        out[self.dim] = self.end - self.start
        return tuple(out)


class TensorSource(Protocol):
    """A checkpoint's tensors by their checkpoint names.

    A caller may rely on: `names()` lists every tensor once, in a stable order; `shape` and `location`
    read no tensor data; `read` returns a CPU tensor in the checkpoint's dtype holding exactly the
    requested slice (reading only that slice where the format allows), which the caller may keep after
    the source is closed. Sources are context managers; nothing may be read after `close()`.
    """

    origin: str  # what the source reads, for error messages (a checkpoint directory or file)

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def location(self, name: str) -> str:
        """Where the tensor is stored, for error messages (a file name)."""
        ...

    def read(self, name: str, part: TensorSlice | None = None) -> torch.Tensor:
        """The tensor, or its `part`; a name `names()` does not list is a KeyError."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> TensorSource: ...

    def __exit__(self, *exc: object) -> None: ...


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: the shards its index lists, or model.safetensors.
    Raises ModelLoadError naming missing shards, or saying there is no checkpoint."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"shards listed in {index} are missing: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


class SafetensorsSource:
    """A Hugging Face safetensors checkpoint (one file, or shards with an index), memory-mapped.

    Every file is opened once, here; `read` of a slice copies only that slice out of the mapping
    (a tensor-parallel rank never holds a whole tensor it shards)."""

    def __init__(self, files: list[Path], origin: str | None = None):
        self.origin = origin or ", ".join(str(f) for f in files)
        self._stack = ExitStack()
        self._file_of: dict[str, tuple[Path, object]] = {}
        try:
            for path in files:
                handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
                for name in handle.keys():
                    if name in self._file_of:
                        raise ModelLoadError(f"tensor {name} is in both {self._file_of[name][0].name} and "
                                             f"{path.name}: a checkpoint holds each tensor once")
                    self._file_of[name] = (path, handle)
        except BaseException:
            self._stack.close()
            raise

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> SafetensorsSource:
        return cls(checkpoint_files(Path(model_dir)), str(model_dir))

    def names(self) -> list[str]:
        return list(self._file_of)  # files in sorted order, each file's tensors in its own order

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file_of[name][1].get_slice(name).get_shape())

    def location(self, name: str) -> str:
        return self._file_of[name][0].name

    def read(self, name: str, part: TensorSlice | None = None) -> torch.Tensor:
        handle = self._file_of[name][1]
        if part is None:
            return handle.get_tensor(name)
        view = handle.get_slice(name)
        if part.dim == 0:
            return view[part.start : part.end]
        return view[:, part.start : part.end]

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> SafetensorsSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_source(model_path: str | Path) -> TensorSource:
    """The tensor source for a model path: a GGUF file (engine/gguf_file.py's `is_gguf_path`) or a Hugging
    Face checkpoint directory, so callers never name a format."""
    from engine.gguf_file import is_gguf_path

    if is_gguf_path(model_path):
        from engine.gguf_source import GGUFSource  # it imports this module's TensorSlice

        return GGUFSource.from_path(str(model_path))
    return SafetensorsSource.from_dir(model_path)
