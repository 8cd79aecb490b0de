"""Backends build rendered sources into callable kernels; agent.py never branches on the target."""

from .base import Backend, Kernel
from .host import HostBackend


def backend_for(target_kind: str) -> Backend:
    if target_kind == "host":
        return HostBackend()
    from ..errors import UserError
    raise UserError(f"no backend for target kind {target_kind!r}: accepted is host")


__all__ = ["Backend", "Kernel", "HostBackend", "backend_for"]
