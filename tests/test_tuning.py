"""`multiattn.tuning` without a framework: the decision cache, its fallbacks, the
interleaved timing (on a fake clock: no assertion here depends on how fast anything runs)
and the CPU description."""

from __future__ import annotations

import threading

import pytest

from multiattn import config, tuning
from multiattn.tuning import _store

X86 = """\
processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 avx512f avx512dq \
avx512bw avx512vl avx512_bf16 amx_bf16 amx_tile amx_int8
bugs\t\t: spectre_v1

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu
"""
AVX2_ONLY = """\
processor\t: 0
model name\t: AMD EPYC 7B12
flags\t\t: fpu sse4_2 avx fma f16c avx2
"""
ARM = """\
processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics asimdhp sve sve2 bf16 i8mm
CPU implementer\t: 0x41
"""


@pytest.fixture(autouse=True)
def fresh():
    """No decisions before or after; timing switched on (the machinery under test), except
    where a test switches it off."""
    tuning.reset()
    with config.settings(autotune=True):
        yield
    tuning.reset()


def _never_timed():
    pytest.fail("a candidate was built: timing was not asked for")


def test_untuned_choices_take_their_default_and_time_nothing():
    with config.settings(autotune=False):
        assert tuning.decide("op", {"n": 1}, _never_timed, fallback="a") == "a"
    (made,) = tuning.decisions()
    assert (made["how"], made["choice"], made["reason"]) == ("default", "a", tuning.UNTUNED)
    assert "autotune off" in tuning.describe_decision(made)
    # asked for later: the class is timed then
    got = tuning.decide("op", {"n": 1}, lambda: ({"b": lambda: 0}, ""), fallback="a")
    assert got == "b" and [d["how"] for d in tuning.decisions()] == ["measured"]


def test_autotune_from_the_environment(monkeypatch):
    monkeypatch.setenv(config.AUTOTUNE_ENV_VAR, "1")
    config.reload_environment()
    try:
        with config.settings(autotune=None):
            assert config.get_autotune() is True
        with config.settings(autotune=False):
            assert config.get_autotune() is False
        monkeypatch.setenv(config.AUTOTUNE_ENV_VAR, "0")
        config.reload_environment()
        with config.settings(autotune=None):
            assert config.get_autotune() is False
        monkeypatch.setenv(config.AUTOTUNE_ENV_VAR, "maybe")
        config.reload_environment()
        with config.settings(autotune=None), pytest.raises(ValueError, match="MULTIATTN_AUTOTUNE"):
            config.get_autotune()
    finally:
        monkeypatch.delenv(config.AUTOTUNE_ENV_VAR)
        config.reload_environment()
    with config.settings(autotune=None):
        assert config.get_autotune() is False  # the default
    with pytest.raises(TypeError, match="autotune"):
        with config.settings(autotune="yes"):
            pass


def test_decisions_saved_and_loaded(tmp_path, monkeypatch):
    cls = {"rows": 64, "out": (8, 8)}
    tuning.decide("op", cls, lambda: ({"b": lambda: 0, "a": lambda: 0}, "sizes"), fallback="a")
    (measured,) = tuning.decisions()
    path = tmp_path / "tuning.json"
    assert tuning.save_decisions(path) == 1
    tuning.reset()
    assert tuning.load_decisions(path) == 1
    with config.settings(autotune=False):  # taken, untimed, with or without autotune
        assert tuning.decide("op", cls, _never_timed, fallback="x") == measured["choice"]
    (loaded,) = tuning.decisions()
    assert loaded["how"] == "loaded" and loaded["shape_class"] == measured["shape_class"]
    assert loaded["median_ms"] == measured["median_ms"]

    other = dict(tuning.cpu_info(), model="another CPU")
    monkeypatch.setattr(_store, "cpu_info", lambda: other)
    with pytest.raises(ValueError, match="another CPU"):
        tuning.load_decisions(path)
    assert tuning.load_decisions(path, any_cpu=True) == 1
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        tuning.load_decisions(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"decisions": []}')
    with pytest.raises(ValueError, match="not a file of save_decisions"):
        tuning.load_decisions(tmp_path / "other.json")


def test_parse_cpuinfo_x86():
    info = tuning.parse_cpuinfo(X86)
    assert info["model"] == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert "avx512_bf16" in info["flags"] and "fpu" in info["flags"]
    assert info["isa"] == [
        "sse4_2",
        "avx",
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512dq",
        "avx512bw",
        "avx512vl",
        "avx512_bf16",
        "amx_tile",
        "amx_bf16",
        "amx_int8",
    ]


def test_parse_cpuinfo_avx2_only_and_arm():
    info = tuning.parse_cpuinfo(AVX2_ONLY)
    assert info["model"] == "AMD EPYC 7B12"
    assert info["isa"] == ["sse4_2", "avx", "avx2", "fma", "f16c"]
    assert not any(f.startswith("avx512") for f in info["isa"])
    arm = tuning.parse_cpuinfo(ARM)
    assert arm["model"] == ""  # no model line; the core numbers are not a model
    assert arm["isa"] == ["asimd", "asimdhp", "bf16", "i8mm", "sve", "sve2"]
    assert tuning.parse_cpuinfo("") == {"model": "", "flags": [], "isa": []}


def test_cpu_info_of_this_machine():
    info = tuning.cpu_info()
    assert isinstance(info["model"], str) and info["model"]
    assert set(info["isa"]) <= set(info["flags"]) and info["cores"] >= 1


class FakeClock:
    """A clock that only the candidates move: each adds its own cost."""

    def __init__(self):
        self.now = 0.0
        self.log: list[str] = []

    def __call__(self):
        return self.now

    def candidate(self, name: str, cost: float):
        def run():
            self.log.append(name)
            self.now += cost
            return name

        return run


@pytest.mark.parametrize(
    ("cost_b", "margin", "choice"),
    [
        (0.97, 0.05, "a"),  # 3% faster: within the margin, the fallback keeps the class
        (0.94, 0.05, "b"),  # 6% faster
        (0.99, 0.0, "b"),  # no margin: the lower median
        (1.0, 0.0, "a"),  # a tie goes to the fallback
    ],
)
def test_the_fallback_keeps_the_class_within_the_margin(monkeypatch, cost_b, margin, choice):
    clock = FakeClock()
    monkeypatch.setattr(_store, "_clock", clock)

    def candidates():
        cost = 2.0**-7  # a binary fraction: the fake clock adds it exactly
        return {"b": clock.candidate("b", cost * cost_b), "a": clock.candidate("a", cost)}, ""

    got = tuning.decide("op", {"n": cost_b, "m": margin}, candidates, fallback="a", margin=margin)
    assert got == choice


@pytest.mark.parametrize(
    ("costs", "choice"),
    [
        ({"1": 1.0, "4": 0.5, "8": 0.51}, "8"),  # 4 and 8 tie: the preferred one
        ({"1": 1.0, "4": 0.5, "8": 0.6}, "4"),  # 8 is 20% slower: the fastest
        ({"1": 0.51, "4": 0.5, "8": 0.5}, "1"),  # the fallback ties: it keeps the class
        ({"1": 1.0, "2": 0.5, "4": 0.5}, "4"),  # "8" did not run: the next preferred
    ],
)
def test_preferred_candidates_win_ties(monkeypatch, costs, choice):
    clock = FakeClock()
    monkeypatch.setattr(_store, "_clock", clock)
    unit = 2.0**-7  # binary fractions: the fake clock adds them exactly

    def candidates():
        return {name: clock.candidate(name, unit * c) for name, c in costs.items()}, ""

    got = tuning.decide("op", costs, candidates, fallback="1", margin=0.05, prefer=["8", "4", "2"])
    assert got == choice


def test_faster_candidate_wins_and_timing_is_interleaved(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(_store, "_clock", clock)
    built = []

    def candidates():
        built.append(1)
        return {"a": clock.candidate("a", 0.003), "b": clock.candidate("b", 0.001)}, "sizes"

    cls = {"rows": 64, "dtype": "float32"}
    assert tuning.decide("op", cls, candidates, fallback="a") == "b"
    # two untimed calls each, then rounds alternating which goes first (each call here
    # outlasts MIN_SAMPLE_S: one call per sample)
    rounds = [name for r in range(tuning.REPEATS) for name in ("ab" if r % 2 == 0 else "ba")]
    assert clock.log == ["a", "a", "b", "b", *rounds]
    (decision,) = tuning.decisions()
    assert decision["choice"] == "b" and decision["how"] == "measured"
    assert decision["median_ms"] == pytest.approx({"a": 3.0, "b": 1.0})
    assert decision["shape_class"] == cls and decision["timed"] == "sizes"
    # cached: no timing for the same class, a new one for another class
    for _ in range(3):
        assert tuning.decide("op", cls, candidates, fallback="a") == "b"
    assert built == [1]
    tuning.decide("op", {"rows": 128, "dtype": "float32"}, candidates, fallback="a")
    assert built == [1, 1] and len(tuning.decisions()) == 2


def test_nothing_is_timed_while_tracing(monkeypatch):
    calls = []
    monkeypatch.setattr(_store, "_measure", lambda *a: calls.append(1) or ({"x": [1.0]}, {}))

    def candidates():
        return {"x": lambda: None}, ""

    cls = {"n": 1}
    got = tuning.decide("op", cls, candidates, fallback="y", measurable=False, reason="traced")
    assert got == "y" and calls == []
    assert tuning.decisions() == [
        {
            "op": "op",
            "shape_class": cls,
            "choice": "y",
            "how": "fallback",
            "median_ms": {},
            "timed": "",
            "reason": "traced",
        }
    ]
    # the fallback is not cached: an eager call measures, and tracing then reuses it
    assert tuning.decide("op", cls, candidates, fallback="y") == "x" and calls == [1]
    assert tuning.decide("op", cls, candidates, fallback="y", measurable=False) == "x"
    assert [d["how"] for d in tuning.decisions()] == ["measured"]


def test_short_calls_are_repeated_within_a_sample(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(_store, "_clock", clock)
    cost = tuning.MIN_SAMPLE_S / 4.5  # five calls per sample

    def candidates():
        return {"short": clock.candidate("short", cost)}, ""

    tuning.decide("op", {"n": 1}, candidates, fallback="short")
    assert len(clock.log) == 2 + 5 * tuning.REPEATS
    assert tuning.decisions()[0]["median_ms"]["short"] == pytest.approx(cost * 1e3)


def test_failing_candidates_drop_out(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(_store, "_clock", clock)

    def broken():
        raise RuntimeError("no kernel for this input")

    def candidates():
        return {"fast": broken, "slow": clock.candidate("slow", 1.0)}, ""

    assert tuning.decide("op", {"n": 1}, candidates, fallback="fast") == "slow"
    assert tuning.decide("op", {"n": 2}, lambda: ({"a": broken}, ""), fallback="z") == "z"
    fallback = tuning.decisions()[1]
    assert fallback["how"] == "fallback" and "no kernel" in fallback["reason"]


def test_concurrent_first_calls_time_once(monkeypatch):
    built = []
    start = threading.Barrier(8)

    def candidates():
        built.append(1)
        return {"a": lambda: None, "b": lambda: None}, ""

    results = []

    def call():
        start.wait()
        with config.settings(autotune=True):  # a thread's settings are its own
            results.append(tuning.decide("op", {"n": 1}, candidates, fallback="a"))

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert built == [1] and len(set(results)) == 1 and len(results) == 8


def test_bucket():
    assert [tuning.bucket(n) for n in (0, 1, 2, 3, 64, 65, 4096)] == [1, 1, 2, 4, 64, 128, 4096]


@pytest.mark.parametrize(("backend", "choice"), [("tensorflow", "saved"), ("jax", "autodiff")])
def test_attention_backward_margin_protects_autodiff_except_on_tensorflow(
    monkeypatch, backend, choice
):
    # the saved weights 3% faster: on TensorFlow they hold what automatic
    # differentiation holds, so nothing untimed argues for keeping it there
    clock = FakeClock()
    monkeypatch.setattr(_store, "_clock", clock)
    unit = 2.0**-7

    def candidates():
        return {
            "autodiff": clock.candidate("autodiff", unit),
            "saved": clock.candidate("saved", unit * 0.97),
        }, ""

    got = tuning.decide(
        "attention-backward", {"backend": backend}, candidates, fallback="autodiff",
        margin=tuning.backward_margin(backend),
    )  # fmt: skip
    assert got == choice


# --- the tuner that times nothing: Fixed -------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "error", "name"),
    [
        ({"attention_chunks": 0}, ValueError, "attention_chunks"),
        ({"attention_chunks": -2}, ValueError, "attention_chunks"),
        ({"attention_chunks": True}, ValueError, "attention_chunks"),
        ({"attention_chunks": 2.0}, ValueError, "attention_chunks"),
        ({"attention_chunks": "4"}, ValueError, "attention_chunks"),
        ({"attention_backward": "manual"}, ValueError, "attention_backward"),
        ({"attention_backward": True}, ValueError, "attention_backward"),
        ({"attention_backward": ""}, ValueError, "attention_backward"),
        ({"torch_linear": "mkl"}, ValueError, "torch_linear"),
        ({"torch_linear": True}, ValueError, "torch_linear"),
    ],
)
def test_fixed_refuses_a_bad_choice_naming_it(kw, error, name):
    with pytest.raises(error, match=rf"Fixed: `{name}` must be .*received"):
        tuning.Fixed(**kw)


def test_fixed_takes_each_choice_and_is_a_tuner_of_settings():
    given = tuning.Fixed(attention_chunks=4, attention_backward="recompute", torch_linear="blas")
    assert (given.attention_chunks, given.attention_backward) == (4, "recompute")
    assert given.torch_linear == "blas"
    for backward in ("autodiff", "recompute", "saved"):
        tuning.Fixed(attention_backward=backward)
    assert tuning.Fixed() == tuning.Fixed(None, None, None)
    with pytest.raises(TypeError, match="blockwise"):  # not a choice: block_size forces it
        tuning.Fixed(blockwise=True)
    assert hash(tuning.Fixed(attention_chunks=2)) == hash(tuning.Fixed(attention_chunks=2))
    with pytest.raises(AttributeError):  # frozen: a key of the kept steps
        given.attention_chunks = 8
    with config.settings(autotune=given):
        assert config.tuner() is given


@pytest.mark.parametrize(
    ("batch", "chunks", "slices"), [(8, None, 1), (8, 4, 4), (8, 3, 2), (6, 4, 3), (7, 16, 7)]
)
def test_fixed_batch_slices_are_the_largest_divisor_not_above_the_count(batch, chunks, slices):
    fixed = tuning.Fixed(attention_chunks=chunks)
    got = fixed.batch_slices({"batch": batch}, _never_timed, [1], True, "")
    assert got == slices


class _Ops:
    """What `Fixed.attention` reads of a namespace: where XLA compiles the call."""

    def __init__(self, device):
        self.device = device

    def xla_device(self, x):
        return self.device


def _spec(**kw):
    from multiattn.ops import plan

    base = dict(
        batch=8, heads=8, kv_heads=8, queries=512, keys=512, key_width=64, value_width=64,
        dtype="float32", capabilities=plan.Capabilities(maps_batch=True),
        memory_budget=1 << 30, traced=True,
    )  # fmt: skip
    return plan.AttentionSpec(**{**base, **kw})


def test_fixed_attention_gives_its_choices_and_the_static_defaults_elsewhere(monkeypatch):
    from multiattn.ops import plan

    monkeypatch.setattr(plan, "glibc", lambda: True)
    cpu = _Ops("cpu")
    # given: taken as they are (the plan takes the largest divisor of the batch)
    got = tuning.Fixed(attention_chunks=2, attention_backward="saved").attention(
        cpu, _spec(), None, None, None, False
    )
    assert (got.chunks, got.backward) == (2, "saved")
    # nothing given: 8 * 8 * 512 * 512 * 4 bytes = 64 MiB of scores under XLA:CPU, in
    # 4 slices of 16 MiB; nothing else decided
    got = tuning.Fixed().attention(cpu, _spec(), None, None, None, False)
    assert (got.chunks, got.backward, got.fused_faster) == (4, None, None)
    got = tuning.Fixed().attention(_Ops(None), _spec(), None, None, None, False)
    assert got.chunks == 1  # not compiled by XLA: one piece
    got = tuning.Fixed().attention(cpu, _spec(traced=False), None, None, None, False)
    assert got.chunks is None  # eager: the slices are not the plan's to choose
