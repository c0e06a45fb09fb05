"""Scoped settings of `multiattn.config`: precedence, nesting, threads and tasks,
validation, the environment read once. Imports no framework."""

from __future__ import annotations

import asyncio
import threading

import pytest

from multiattn import config


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv(config.BUDGET_ENV_VAR, raising=False)
    monkeypatch.delenv(config.ONEDNN_ENV_VAR, raising=False)
    config.reload_environment()
    config.set_attention_memory_budget(None)
    config.set_torch_onednn(None)
    yield
    config.set_attention_memory_budget(None)
    config.set_torch_onednn(None)
    config.reload_environment()


def test_precedence_scope_then_setter_then_environment_then_default(monkeypatch):
    assert config.get_attention_memory_budget() == config.DEFAULT_ATTENTION_MEMORY_BUDGET
    monkeypatch.setenv(config.BUDGET_ENV_VAR, "2KiB")
    monkeypatch.setenv(config.ONEDNN_ENV_VAR, "off")
    config.reload_environment()
    assert config.get_attention_memory_budget() == 2048 and config.get_torch_onednn() is False
    config.set_attention_memory_budget(1000)
    config.set_torch_onednn(True)
    assert config.get_attention_memory_budget() == 1000 and config.get_torch_onednn() is True
    with config.settings(attention_memory_budget="1KiB", torch_onednn=False):
        assert config.get_attention_memory_budget() == 1024
        assert config.get_torch_onednn() is False
        with config.settings(attention_memory_budget=None):  # the process-wide value
            assert config.get_attention_memory_budget() == 1000
            assert config.get_torch_onednn() is False  # left out: the enclosing value
    assert config.get_attention_memory_budget() == 1000 and config.get_torch_onednn() is True


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
    with pytest.raises(TypeError, match=r"`torch_onednn` expects True, False or None; received 1"):
        with config.settings(torch_onednn=1):
            pass
    with pytest.raises(ValueError, match=r"budget.*'lots'"):
        with config.settings(attention_memory_budget="lots"):
            pass
    with pytest.raises(TypeError, match="unexpected keyword"):
        with config.settings(budget=1):  # keyword-only, no unknown names
            pass


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
