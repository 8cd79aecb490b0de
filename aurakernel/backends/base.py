"""The Backend protocol and the Kernel it produces."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from ..codegen import Source

_CTYPES = {"ptr": ctypes.c_void_p, "i64": ctypes.c_int64, "f32": ctypes.c_float}


@dataclass(frozen=True)
class Entry:
    """A C entry point: its symbol, argument kinds ('ptr', 'i64', 'f32') and result kind."""

    symbol: str
    args: tuple[str, ...]
    result: str | None = None


@dataclass
class Kernel:
    """Rendered source + build artifact + callable entry points."""

    source: Source
    artifact: Path
    entries: dict[str, Entry]
    backend: str
    build_s: float = 0.0
    meta: dict = field(default_factory=dict)   # the typed values the source was rendered from
    _functions: dict = field(default_factory=dict, repr=False)
    _scratch: dict = field(default_factory=dict, repr=False)

    @property
    def source_hash(self) -> str:
        return self.source.hash

    def bind(self, lib: ctypes.CDLL) -> None:
        for name, entry in self.entries.items():
            fn = getattr(lib, entry.symbol)
            fn.restype = _CTYPES[entry.result] if entry.result else None
            fn.argtypes = [_CTYPES[a] for a in entry.args]
            self._functions[name] = (fn, entry)

    def call(self, name: str, *args):
        """Call entry `name`; tensors are passed by data pointer (the caller guarantees layout)."""
        fn, entry = self._functions[name]
        if len(args) != len(entry.args):
            raise TypeError(f"{entry.symbol} takes {len(entry.args)} arguments, got {len(args)}")
        return fn(*[a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args])

    def workspace(self, name: str) -> torch.Tensor:
        """The fp32 scratch buffer whose size (in floats) entry `name` reports. Allocated once per
        kernel and reused: fresh multi-MB buffers cost page faults on every call. Kernels write
        before they read their scratch, and calls into one kernel do not overlap."""
        buf = self._scratch.get(name)
        if buf is None:
            buf = self._scratch[name] = torch.empty(int(self.call(name)), dtype=torch.float32)
        return buf

    def workspace_of(self, floats: int) -> torch.Tensor:
        """A reusable fp32 scratch buffer of at least `floats` (grows when a call needs more)."""
        buf = self._scratch.get("_sized")
        if buf is None or buf.numel() < floats:
            buf = self._scratch["_sized"] = torch.empty(max(floats, 1), dtype=torch.float32)
        return buf


class Backend(Protocol):
    name: str

    def available(self) -> tuple[bool, str]:
        """(usable here, why not)."""

    def build(self, source: Source, entries: dict[str, Entry]) -> Kernel:
        ...

    def run(self, kernel: Kernel, entry: str, *args) -> None:
        ...
