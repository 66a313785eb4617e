"""The methods by name: filled by :mod:`hvcomm.torch.methods` (which imports every module of
its ``MODULES`` and adds each one's ``METHOD``), read by everything that takes a method's name.
It imports no method, so the method kinds (:mod:`delayed`, :mod:`periodic`, :mod:`schedule`)
can look their methods up here without an import running back up to the package."""
from __future__ import annotations

from typing import Dict, List, Optional

from collectives.errors import HvcommError

from .base import Method

REGISTRY: Dict[str, Method] = {}


def add(method: Method) -> None:
    assert method.name not in REGISTRY, f"two methods named {method.name!r}"
    REGISTRY[method.name] = method


def names(role: Optional[str] = None) -> List[str]:
    """The methods' names, in registry order (those of one ``role`` if given)."""
    return [m.name for m in REGISTRY.values() if role is None or m.role == role]


def get(name: str, role: Optional[str] = None) -> Method:
    """The method called ``name`` (of ``role`` if given); an unknown name lists the valid ones."""
    method = REGISTRY.get(name) if isinstance(name, str) else None
    if method is None or (role is not None and method.role != role):
        what = f"{role} method" if role else "method"
        raise HvcommError(f"unknown {what} {name!r}; choose one of {names(role)}")
    return method
