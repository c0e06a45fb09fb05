"""Scoped settings of `multiattn.config`: precedence, nesting, threads and tasks,
validation, the environment read once. Imports no framework."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest

from multiattn import config


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv(config.BUDGET_ENV_VAR, raising=False)
    monkeypatch.delenv(config.AUTOTUNE_ENV_VAR, raising=False)
    config.reload_environment()
    config.set_attention_memory_budget(None)
    yield
    config.set_attention_memory_budget(None)
    config.reload_environment()


def test_precedence_scope_then_setter_then_environment_then_default(monkeypatch):
    assert config.get_attention_memory_budget() == config.DEFAULT_ATTENTION_MEMORY_BUDGET
    assert config.get_autotune() is False
    monkeypatch.setenv(config.BUDGET_ENV_VAR, "2KiB")
    monkeypatch.setenv(config.AUTOTUNE_ENV_VAR, "on")
    config.reload_environment()
    assert config.get_attention_memory_budget() == 2048 and config.get_autotune() is True
    config.set_attention_memory_budget(1000)
    assert config.get_attention_memory_budget() == 1000
    with config.settings(attention_memory_budget="1KiB", autotune=False):
        assert config.get_attention_memory_budget() == 1024
        assert config.get_autotune() is False
        with config.settings(attention_memory_budget=None):  # the process-wide value
            assert config.get_attention_memory_budget() == 1000
            assert config.get_autotune() is False  # left out: the enclosing value
        with config.settings(autotune=None):  # the process-wide value: the environment's
            assert config.get_autotune() is True
    assert config.get_attention_memory_budget() == 1000 and config.get_autotune() is True


def test_the_environment_is_read_once(monkeypatch):
    assert config.get_attention_memory_budget() == config.DEFAULT_ATTENTION_MEMORY_BUDGET
    monkeypatch.setenv(config.BUDGET_ENV_VAR, "64k")
    assert config.get_attention_memory_budget() == config.DEFAULT_ATTENTION_MEMORY_BUDGET
    config.reload_environment()
    assert config.get_attention_memory_budget() == 64000


def test_block_size_is_scoped_and_validated():
    assert config.get_block_size() is None
    with config.settings(block_size=8):
        assert config.get_block_size() == (8, 8)
        with config.settings(block_size=(2, 3)):
            assert config.get_block_size() == (2, 3)
        assert config.get_block_size() == (8, 8)
    assert config.get_block_size() is None
    for bad in (0, (1, 2, 3), 2.5, True, "4"):
        with (
            pytest.raises(ValueError, match=r"settings: `block_size`.*received"),
            config.settings(block_size=bad),
        ):
            pass


def test_bad_values_name_the_setting():
    with pytest.raises(TypeError, match=r"`fused_attention` expects True, False or None; "):
        with config.settings(fused_attention=1):
            pass
    with pytest.raises(ValueError, match=r"budget.*'lots'"):
        with config.settings(attention_memory_budget="lots"):
            pass
    with pytest.raises(TypeError, match="unexpected keyword"):
        with config.settings(budget=1):  # keyword-only, no unknown names
            pass


@pytest.mark.parametrize("removed", ["torch_onednn", "attention_chunks", "blockwise_attention"])
def test_the_measured_choices_have_no_setting_of_their_own(removed):
    with pytest.raises(TypeError, match="unexpected keyword"):
        with config.settings(**{removed: None}):
            pass


class _NotATuner:
    def attention(self, *args):  # the other two methods are missing
        return None


@pytest.mark.parametrize("bad", ["yes", 1, 0.5, object(), _NotATuner(), {"chunks": 2}])
def test_autotune_refuses_what_is_not_a_tuner(bad):
    with pytest.raises(TypeError, match=r"settings: `autotune` expects True, False, None"):
        with config.settings(autotune=bad):
            pass
    assert config.get_autotune() is False


def test_a_scope_is_exited_on_error():
    with pytest.raises(RuntimeError), config.settings(block_size=4):
        raise RuntimeError
    assert config.get_block_size() is None


def test_scopes_are_thread_local():
    seen = {}
    entered, release = threading.Event(), threading.Event()

    def worker():
        with config.settings(attention_memory_budget=123):
            entered.set()
            release.wait(5)
            seen["worker"] = config.get_attention_memory_budget()

    thread = threading.Thread(target=worker)
    thread.start()
    entered.wait(5)
    seen["main"] = config.get_attention_memory_budget()
    release.set()
    thread.join(5)
    assert seen == {"worker": 123, "main": config.DEFAULT_ATTENTION_MEMORY_BUDGET}


def test_scopes_are_task_local():
    async def task(budget, gate):
        with config.settings(attention_memory_budget=budget):
            await gate.wait()
            return config.get_attention_memory_budget()

    async def main():
        gate = asyncio.Event()
        tasks = [asyncio.create_task(task(b, gate)) for b in (100, 200)]
        await asyncio.sleep(0)
        outside = config.get_attention_memory_budget()
        gate.set()
        return await asyncio.gather(*tasks), outside

    got, outside = asyncio.run(main())
    assert got == [100, 200] and outside == config.DEFAULT_ATTENTION_MEMORY_BUDGET


def test_attention_memory_budget_yields_the_budget_in_force():
    with config.attention_memory_budget("1KiB") as inside:
        assert inside == config.get_attention_memory_budget() == 1024
    assert config.get_attention_memory_budget() == config.DEFAULT_ATTENTION_MEMORY_BUDGET


# --- who makes the measured choices: config.tuner ----------------------------------------


def test_no_tuner_by_default_and_the_tuning_package_is_not_imported():
    code = (
        "import sys\n"
        "from multiattn import config\n"
        "assert config.get_autotune() is False and config.tuner() is None\n"
        "with config.settings(autotune=False):\n"
        "    assert config.tuner() is None\n"
        "assert 'multiattn.tuning' not in sys.modules, sorted(sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != config.AUTOTUNE_ENV_VAR}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_the_tuner_in_force(tmp_path):
    from multiattn import tuning

    tuning.reset()
    try:
        assert config.tuner() is None
        with config.settings(autotune=True):
            assert config.get_autotune() is True
            assert config.tuner() is tuning.MEASURED
            assert isinstance(tuning.MEASURED, tuning.Measured)
        fixed = tuning.Fixed(attention_chunks=2)
        with config.settings(autotune=fixed):
            assert config.get_autotune() is fixed and config.tuner() is fixed
            with config.settings(autotune=None):  # the process-wide value: off
                assert config.tuner() is None
            with config.settings(autotune=True):
                assert config.tuner() is tuning.MEASURED
        assert config.tuner() is None
        # decisions this process holds (timed or loaded) are used with autotune off too
        with config.settings(autotune=True):
            tuning.decide("op", {"n": 1}, lambda: ({"a": lambda: 0}, ""), fallback="a")
        assert config.tuner() is tuning.MEASURED
        path = tmp_path / "decisions.json"
        assert tuning.save_decisions(path) == 1
        tuning.reset()
        assert config.tuner() is None
        assert tuning.load_decisions(path) == 1
        assert config.tuner() is tuning.MEASURED
        with config.settings(autotune=fixed):  # a Fixed tuner still wins
            assert config.tuner() is fixed
    finally:
        tuning.reset()
    assert config.tuner() is None


def test_the_fingerprint_holds_the_tuner():
    from multiattn import tuning

    fixed = tuning.Fixed(attention_backward="saved")
    assert dict(config.fingerprint())["autotune"] is False
    with config.settings(autotune=fixed, block_size=4, fused_attention=False):
        got = dict(config.fingerprint())
    assert got == {
        "attention_memory_budget": 1 << 30,
        "block_size": (4, 4),
        "fused_attention": False,
        "autotune": fixed,
    }
    again = tuning.Fixed(attention_backward="saved")
    with config.settings(autotune=again, block_size=4, fused_attention=False):
        assert config.fingerprint() == tuple(got.items())  # equal tuners, one fingerprint
    assert hash(again) == hash(fixed)  # a key of the kept steps
