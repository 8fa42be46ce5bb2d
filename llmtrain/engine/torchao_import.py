"""Import torchao without its import-time log lines on every rank.

torchao 0.18 under torch 2.13 logs, on its first import (so once per rank of every fp8 run and
every run with ``train.optimizer.states`` 8bit / bf16):

- ``torch.utils._pytree``: "<enum 'KernelPreference'> is an Enum subclass and is now natively
  supported by torch.compile ... Calling register_constant() on Enum subclasses is deprecated"
  (torchao registers that Enum as a pytree constant; torch 2.13 deprecates the call);
- ``torchao``: "Failed to load .../_C_*.so: ..." for each prebuilt extension this machine cannot
  load (its CUDA-only kernels on a CPU machine, the mxfp8 build for another python). The engine
  uses none of them: ``Float8Linear`` runs ``torch._scaled_mm``, the quantized AdamW torchao's
  torch code.

:func:`import_torchao` drops those records only, and only while the module is imported; anything
else torch or torchao log goes through.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

# (logger, the start of the message format that is dropped)
QUIET = (("torch.utils._pytree", "%s is an Enum subclass and is now natively supported"),
         ("torchao", "Failed to load "))


class _Drop(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def import_torchao(name: str) -> ModuleType:
    """``importlib.import_module(name)`` (a torchao module) with the records of :data:`QUIET` dropped;
    ImportError propagates (the callers turn it into their one-line error)."""
    installed = [(logging.getLogger(logger), _Drop(prefix)) for logger, prefix in QUIET]
    for log, drop in installed:
        log.addFilter(drop)
    try:
        return importlib.import_module(name)
    finally:
        for log, drop in installed:
            log.removeFilter(drop)
