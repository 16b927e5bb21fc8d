"""Layer functions compiled by TorchScript, once per process.

TorchScript is deprecated in favour of torch.compile, but for these per-layer functions it measured faster: the
same glue under torch.compile took 27.9 ms a draft step against 17.4 ms scripted (its per-call guards cost more
than the ops they replace; starjar.model.lean_step). Its deprecation warning is silenced here, where it is chosen.
"""

from __future__ import annotations

import threading
import warnings

import torch

_scripted: dict[tuple[str, str], torch.jit.ScriptFunction] = {}
_compiling = threading.Lock()


def scripted(fn) -> torch.jit.ScriptFunction:
    """fn compiled once per process (about 0.2 s a function: callers ask at load, not in a step)."""
    key = (fn.__module__, fn.__name__)
    with _compiling:
        if key not in _scripted:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", r".*torch\.jit\.script.*deprecated", DeprecationWarning)
                _scripted[key] = torch.jit.script(fn)
    return _scripted[key]
