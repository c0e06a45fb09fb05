"""``multiattn bench``: multiattn's attention against each framework's own layers.

`main` is the command line (``multiattn bench --help``); `multiattn.bench.worker` times
one framework in its own process and `multiattn.bench.long` one long-sequence length.
Importing this package imports no framework.
"""

from .common import attention_flops
from .main import main

__all__ = ["attention_flops", "main"]
