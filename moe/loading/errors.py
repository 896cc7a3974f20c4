"""Errors raised while loading a safetensors checkpoint.

Every error names the file and, where one is involved, the tensor: the canonical
(runtime) name and the checkpoint name(s) it was looked up under. All derive from
``LoadError`` and from the builtin a caller would naturally catch
(``FileNotFoundError`` for absent files, ``ValueError`` for bad content).
"""

from __future__ import annotations


class LoadError(Exception):
    """Base class of every checkpoint-loading error."""

    def __reduce__(self):  # picklable whatever the subclass's __init__ takes (a rank's error crosses Ray
        # to the driver), with its fields and its message as it stands (the executor rewrites it)
        return _rebuild, (type(self), self.__dict__, self.args)


class CheckpointNotFoundError(LoadError, FileNotFoundError):
    """The path, its safetensors files, or a shard named by the index does not exist."""


class NoWeightsError(CheckpointNotFoundError):
    """A checkpoint directory holds no safetensors weights (and no pickle-based ones to refuse)."""


class CheckpointFormatError(LoadError, ValueError):
    """A file exists but cannot be used: corrupt or truncated safetensors, a bad index,
    a pickle-based weight file (refused, never unpickled), an unsupported dtype."""


class MissingTensorError(LoadError, ValueError):
    """A tensor the model needs is in no shard of the checkpoint."""

    def __init__(self, canonical: str, tried: list[str], where: str, hint: str = "") -> None:
        self.canonical = canonical
        self.tried = list(tried)
        names = ", ".join(repr(t) for t in tried)
        super().__init__(f"{where}: tensor {canonical!r} not found; looked for checkpoint name(s) {names}"
                         + (f"; {hint}" if hint else ""))


class TensorShapeError(LoadError, ValueError):
    """A checkpoint tensor's shape differs from the shape the model expects."""

    def __init__(self, canonical: str, key: str, expected: tuple[int, ...], found: tuple[int, ...], where: str) -> None:
        self.canonical = canonical
        self.key = key
        self.expected = tuple(expected)
        self.found = tuple(found)
        label = canonical if canonical == key else f"{canonical} (checkpoint {key!r})"
        super().__init__(f"{where}: shape mismatch for {label}: expected {list(expected)}, found {list(found)}")


class UnexpectedTensorError(LoadError, ValueError):
    """The checkpoint holds tensors the model has no place for: a decoder layer past config.json's
    ``num_hidden_layers`` (beyond DeepSeek-V3's ``num_nextn_predict_layers`` MTP layers, which are
    skipped), or a name no part of the model reads. vLLM's ``load_weights`` raises ``KeyError`` for
    both; a config.json that does not describe its checkpoint would otherwise serve a truncated model."""


def _rebuild(cls: type[LoadError], state: dict, args: tuple) -> LoadError:
    """An error of ``cls`` with ``state`` and ``args`` (its message, possibly rewritten since it was
    raised), without calling its ``__init__``: the unpickling half of ``LoadError.__reduce__``."""
    err = cls.__new__(cls)
    err.__dict__.update(state)
    err.args = args
    return err
