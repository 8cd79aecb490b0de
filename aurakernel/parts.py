"""An operator's parts beyond its definition (a target's kernel, its patch) and the registries that
find them by operator name: the built-in ones and those a third-party package registers."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

from .errors import UserError

if TYPE_CHECKING:
    from .ops.base import OpSpec

P = TypeVar("P", bound="Part")


class Registry(dict[str, P], Generic[P]):
    """operator name -> its part of one kind ("a host kernel", "an AscendC kernel", "a patch")."""

    def __init__(self, what: str, missing: str):
        super().__init__()
        self.what, self.missing = what, missing

    def add(self, part: P) -> P:
        """Register `part` for its operator (idempotent for the same part; another one is refused)."""
        have = self.get(part.spec.name)
        if have is not None and have is not part:
            raise UserError(f"operator {part.spec.name!r} already has {self.what} ({type(have).__name__})")
        self[part.spec.name] = part
        return part

    def load(self, *modules) -> None:
        """Register the parts the built-in modules list in their PARTS."""
        for module in modules:
            for part in module.PARTS:
                self.add(part)

    def of(self, spec: OpSpec) -> P:
        """The operator's part; a one-line error naming the operators that have one."""
        part = self.get(spec.name)
        if part is None:
            raise UserError(f"operator {spec.name!r} {self.missing}: available for {', '.join(sorted(self))}")
        return part


class Part:
    """A piece of one operator (its OpSpec): each kind has one registry."""

    registry: ClassVar[Registry]

    def __init__(self, spec: OpSpec):
        self.spec = spec

    def register(self):
        """Make this the operator's part of its kind (aurakernel.register calls it)."""
        return self.registry.add(self)
