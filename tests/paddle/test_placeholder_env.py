"""The Paddle worker's environment: no Keras backend was chosen for it."""

import os


def test_worker_runs_without_a_chosen_keras_backend():
    assert "KERAS_BACKEND" not in os.environ
