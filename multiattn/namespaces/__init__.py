"""The namespaces: the ``keras.ops``-shaped operations the core is written with.

* `multiattn.namespaces.contract`: `Namespace`, the declared contract every namespace
  implements (operations, their shapes and dtypes, and capability flags), and
  `check_namespace`, which verifies one.
* `multiattn.namespaces.keras`: `KerasNamespace` over ``keras.ops`` for Keras' jax, torch,
  tensorflow and numpy backends (a subclass per backend for what Keras leaves out), the
  registry of namespaces and `get_ops`, which finds the one for a call's tensors.
* `multiattn.namespaces.paddle`: `PaddleNamespace` over PaddlePaddle (Keras has no Paddle
  backend); importing it imports paddle.

They import nothing of the rest of the library but `multiattn.config` and its checks,
so the math above them is written once for every framework.
"""
