"""Inner layers that ``unwrap`` peels: ``torch.compile`` and PEFT."""

from ._layer import Layer
from .compile import CompileLayer
from .peft import PeftLayer

__all__ = ["Layer", "CompileLayer", "PeftLayer", "LAYERS"]

LAYERS: tuple[type[Layer], ...] = (CompileLayer, PeftLayer)
