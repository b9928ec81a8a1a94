"""Silence the few lines dependencies print that tell a trainmesh user nothing they can act on, each by its
exact words on the one logger that prints it: torchao's ``Failed to load .../torchao/_C_*.so`` (kernels
trainmesh does not use) and torch's ``... is an Enum subclass and is now natively supported by
torch.compile`` (a deprecated call inside torchao)."""

from __future__ import annotations

import logging
import re

QUIETED = {
    "torchao": re.compile(r"Failed to load \S*/torchao/_C\w*[.\w-]*\.so: "),
    "torch.utils._pytree": re.compile(r"<enum '\w+'> is an Enum subclass and is now natively supported by "
                                      r"torch\.compile"),
}
"""Logger name -> the start of the only message dropped from it."""


class _DropMessage(logging.Filter):
    """Drop the records of one logger whose message starts with ``pattern``."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.match(record.getMessage()) is None


def quiet_dependencies() -> None:
    """Install the filters of :data:`QUIETED` once (a logger keeps its filters whoever configures it later)."""
    for name, pattern in QUIETED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(_DropMessage(pattern))
