"""Paddle worker: runs with no Keras backend chosen, so the Paddle adapter picks Keras'
numpy backend; paddle is imported first (importing it after TensorFlow segfaults)."""

import paddle  # noqa: F401  (first, before anything that could load TensorFlow)
import pytest


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", ["paddle"], ids=["paddle"])


@pytest.fixture(autouse=True)
def backend():  # replaced by the parametrisation above; kept so every test gets the id
    return "paddle"
