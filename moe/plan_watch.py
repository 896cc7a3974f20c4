"""What a decode plan depends on, announced when it changes instead of read back every step.

``moe.decode_plan.DecodePlan`` holds while its state is unchanged: every switch its decisions read
and every parameter's identity and in-place version. Reading all of that back each step (~380
attributes and ~240 parameters on the small DeepSeek-style checkpoint) touches ~1,800 cache lines
that the step's weight stream has evicted: 0.3-0.45 ms of a 5.5-7.5 ms batch-1 step on Zen 5. So
the modules a plan resolves announce their changes instead:

- ``WatchedModule`` (the base of every module class with ``DECISION_ATTRS`` or parameters that a
  plan resolves) counts in ``epoch()`` each assignment or deletion of a decision switch, of a
  parameter or of a buffer, each ``register_parameter`` / ``register_buffer`` and each move or
  cast (``.to()``, ``_apply``);
- in-place writes to a parameter's data (loading, expert migration, ``p.data = ...``, TP slicing)
  show in its version or address, which ``kernels.tensor_watch`` compares for all of a plan's
  parameters in one C++ loop.

What neither sees is read back every step (``DecodePlan.holds``): switches held on a class
(``Linear.use_kernel = False``). A change made around ``__setattr__`` (writing ``module.__dict__``
directly) is not seen, nor a mutable switch value changed in place (which the full comparison,
holding that same object, did not see either).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_epoch = 0


def epoch() -> int:
    """How many announced changes (``WatchedModule``) this process has seen."""
    return _epoch


def _bump() -> None:
    global _epoch
    _epoch += 1


def decision_attrs(cls: type) -> tuple[str, ...]:
    """The switches a module class's op decisions read: ``DECISION_ATTRS`` of the class and its bases."""
    attrs = _ATTRS_BY_CLASS.get(cls)
    if attrs is None:
        names: list[str] = []
        for klass in cls.__mro__:
            for name in klass.__dict__.get("DECISION_ATTRS", ()):
                if name not in names:
                    names.append(name)
        attrs = _ATTRS_BY_CLASS[cls] = tuple(names)
    return attrs


_ATTRS_BY_CLASS: dict[type, tuple[str, ...]] = {}


class WatchedModule(nn.Module):
    """``nn.Module`` that announces (``epoch()``) every change a decode plan's state would show:
    its decision switches, parameters and buffers assigned, deleted or registered."""

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        d = self.__dict__
        if (name in decision_attrs(type(self)) or isinstance(value, torch.Tensor)
                or name in d.get("_parameters", ()) or name in d.get("_buffers", ())):
            _bump()

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        _bump()

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        super().register_parameter(name, param)
        _bump()

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        super().register_buffer(name, tensor, persistent)
        _bump()

    def _apply(self, fn: Any, recurse: bool = True) -> WatchedModule:
        # .to() / .float() / .cuda() replace parameters and buffers in their dicts, around __setattr__
        out = super()._apply(fn, recurse)
        _bump()
        return out
