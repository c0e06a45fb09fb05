"""Running multiattn layers on several devices with the frameworks' own engines.

Nothing here imports a framework until it is used (``import multiattn.distributed``
loads no framework):

* `layout_map` (`multiattn.distributed.layout`): the ``keras.distribution.LayoutMap`` that
  shards multiattn's weights over the model axis of a device mesh (attention by head,
  feed-forward by column then row), for ``keras.distribution.ModelParallel``.
* `ring_attention` (`multiattn.distributed.ring`): sequence-parallel exact attention on
  JAX; queries, keys and values are split along the sequence over the devices of one
  mesh axis, and key/value blocks travel around the ring.

Data parallelism needs nothing from multiattn: ``keras.distribution.DataParallel`` on JAX
and ``torch.nn.parallel.DistributedDataParallel`` on PyTorch take the layers unchanged.
See the "Scaling out" page of the documentation.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["layout_map", "model_parallel", "ring_attention", "sharded_heads_rules"]

_WHERE = {
    "layout_map": "layout",
    "model_parallel": "layout",
    "sharded_heads_rules": "layout",
    "ring_attention": "ring",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'multiattn.distributed' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
