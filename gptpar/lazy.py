"""A package's public names resolved on first use (PEP 562), so that importing the package, or a torch-free module
inside it, imports nothing heavy. gptpar, gptpar.data and gptpar.tensor_parallel each declare {name: module}."""
import importlib
from typing import Callable, Dict, List, Tuple


def lazy_exports(package: str, exports: Dict[str, str]) -> Tuple[List[str], Callable, Callable]:
    """(__all__, __getattr__, __dir__) for `package`: each name in `exports` imported from its module when first
    read, then kept in the package's globals."""
    names = sorted(exports)

    def __getattr__(name):
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
            setattr(importlib.import_module(package), name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(vars(importlib.import_module(package))) | set(names))

    return names, __getattr__, __dir__
