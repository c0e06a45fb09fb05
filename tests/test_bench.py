"""``multiattn bench``: every implementation runs and is reported; long-sequence mode.

The runs (the main benchmark, and long sequences forward and with the backward pass) are
real subprocesses of the installed command (``--quick``: tiny shapes), started together
so the test takes about as long as the longest of them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import mmap
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from multiattn.bench import attention_flops
from multiattn.bench.impls import FRAMEWORKS

EXPECTED = {
    "jax": ["multiattn-jax", "keras-jax", "flax-nnx"],
    "torch": ["multiattn-torch", "torch-nn", "keras-torch"],
    "tensorflow": ["multiattn-tf", "keras-tf"],
    "paddle": ["multiattn-paddle", "paddle-nn"],
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _installed(framework: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in FRAMEWORKS[framework][1])


def _bench(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "multiattn.cli", "bench", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("bench")
    args = {
        "main": ["--quick", "--autotune"],
        "long": ["--long", "--quick", "--long-lengths", "256,512"],
        "long_backward": ["--long", "--long-backward", "--quick", "--long-lengths", "256"],
        "decode": ["--decode", "--quick", "--frameworks", "torch,paddle", "--decode-prompts", "8",
                   "--decode-batches", "1,2", "--decode-new-tokens", "3", "--repeats", "1"],
    }  # fmt: skip
    paths = {name: (tmp / f"{name}.json", tmp / f"{name}.png") for name in args}
    procs = {
        name: _bench(*extra, "--json", str(paths[name][0]), "--plot", str(paths[name][1]))
        for name, extra in args.items()
    }
    out = {}
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, log
        out[name] = (json.loads(paths[name][0].read_text()), paths[name][1], log)
    return out


def _png(path: Path) -> bool:
    return path.exists() and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000


def test_quick_run_reports_every_implementation(runs):
    report, png, log = runs["main"]
    assert _png(png)
    machine = report["machine"]
    assert machine["cpu"] and set(machine["cpu_isa"]) <= set(machine["cpu_flags"])
    assert "CPU: " in log and "instruction sets:" in log and "Kernel choices" in log
    assert machine["transparent_hugepages"] in ("always", "madvise", "never", None)
    assert isinstance(machine["malloc_env"], dict) and "Memory: transparent huge pages" in log
    cfg = report["config"]
    assert (cfg["batch"], cfg["length"], cfg["width"], cfg["heads"]) == (2, 64, 64, 4)
    assert report["flops"]["forward"] == attention_flops(2, 64, 64, 4)["forward"]
    by_id = {(r["framework"], r["id"]): r for r in report["implementations"]}
    for framework, ids in EXPECTED.items():
        info = report["frameworks"][framework]
        if not _installed(framework):
            assert info["status"] == "skipped" and "not installed" in info["reason"]
            continue
        assert info["status"] == "ran", info
        mm = info["matmul"]
        assert mm["gflops"] > 0 and mm["numpy_float32_gflops"] > 0
        assert mm["gflops"] == max(mm["routes"].values()) == mm["routes"][mm["route"]]
        if framework == "torch" and info["info"].get("torch_onednn_projections"):
            assert set(mm["routes"]) == {"matmul", "oneDNN linear"}
            if info["info"]["torch_projection_library"].startswith("torch.addmm (default"):
                # the autotuned twin measured the forward, input and weight gradients of
                # the projections; the default implementation timed nothing and recorded
                # nothing (no tuner in force)
                choices = info["kernel_choices"]
                measured = [c for c in choices if c["how"] == "measured"]
                assert {c["op"] for c in measured} == {"torch-linear"}
                assert sum(c["op"] == "torch-linear" for c in measured) >= 3
                assert {c["how"] for c in choices} == {"measured"}
                assert all(c["choice"] in c["median_ms"] for c in measured)
            assert info["cpu_capability"]
        assert info["process_max_rss_mib"] > 0
        ratios = []
        assert cfg["autotune"]  # every multiattn implementation again, autotuned
        for ident in [*ids, f"{ids[0]}-autotuned"]:
            rec = by_id[(framework, ident)]
            assert rec["status"] == "ok", rec
            for mode in ("forward", "fwd_bwd"):
                stats = rec[mode]
                assert stats["median_ms"] > 0 and len(stats["times_ms"]) == cfg["repeats"]
                assert stats["ratio"] > 0 and math.isfinite(stats["ratio"])
                assert stats["gflops"] > 0 and stats["peak_fraction"] > 0
                assert stats["peak_mem_mib"] >= 0
                assert stats["page_faults_per_call"] >= 0
                ratios.append((rec["kind"], mode, stats["ratio"]))
        # the fastest native layer of each pass has ratio 1 exactly
        for mode in ("forward", "fwd_bwd"):
            assert min(r for k, m, r in ratios if k == "native" and m == mode) == 1.0


def test_long_quick_run(runs):
    report, png, _ = runs["long"]
    assert _png(png)
    long = report["long"]
    assert long["backend"] == "torch"
    assert [e["length"] for e in long["results"]] == [256, 512]
    for entry in long["results"]:
        assert entry["status"] == "ok", entry
        assert entry["median_ms"] > 0 and entry["gflops"] > 0
        assert entry["peak_mem_mib"] is not None and entry["peak_mem_mib"] >= 0
        assert entry["score_matrix_gib"] == pytest.approx(8 * entry["length"] ** 2 * 4 / 2**30)
    # the comparison with the budget lifted: the whole score matrix at every length
    for path in ("blockwise", "direct"):
        entries = long[f"{path}_results"]
        assert [(e["length"], e["path"]) for e in entries] == [(256, path), (512, path)]
        for entry in entries:
            assert entry["status"] == "ok", entry
            assert entry["median_ms"] > 0 and entry["peak_mem_mib"] >= 0


def test_long_quick_run_with_the_backward_pass(runs):
    report, png, log = runs["long_backward"]
    assert _png(png)
    long = report["long"]
    assert long["backward"] is True and "forward+backward" in log
    for entry in (*long["results"], *long["blockwise_results"], *long["direct_results"]):
        assert entry["status"] == "ok", entry
        assert entry["length"] == 256 and entry["median_ms"] > 0
        # forward and backward count three times the forward FLOPs
        flops = 3 * 2 * 2 * 8 * 256 * 256 * 64
        assert entry["gflops"] == pytest.approx(flops / (entry["median_ms"] / 1e3) / 1e9)


def test_flop_count():
    f = attention_flops(8, 512, 512, 8)
    assert f["projections"] == 4 * 2 * 8 * 512 * 512 * 512
    assert f["scores"] == f["weighted_sum"] == 2 * 8 * 8 * 512 * 512 * 64
    assert f["forward"] == f["projections"] + f["scores"] + f["weighted_sum"]
    assert f["fwd_bwd"] == 3 * f["forward"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--width", "10", "--heads", "4"], "not divisible"),
        (["--frameworks", "mxnet"], "mxnet"),
        (["--long-lengths", "1k"], "--long-lengths"),
        (["--long", "--long-backward", "--long-backend", "numpy"], "no gradients"),
        (["--decode", "--decode-prompts", "0"], "--decode-prompts"),
        (["--decode", "--decode-new-tokens", "1"], "at least 2"),
    ],
)
def test_bad_options_are_usage_errors(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "multiattn.cli", "bench", *args], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.skipif(not _installed("torch"), reason="torch is not installed")
def test_decode_quick_run_times_both_models_beside_transformers(runs):
    report, png, log = runs["decode"]
    section = report["decode"]
    for fw in ("torch", "paddle"):
        assert section["frameworks"][fw]["status"] == "ran", section["frameworks"]
    cases = {(r["framework"], r["model"], r["batch"], r["implementation"])
             for r in section["rows"]}  # fmt: skip
    assert cases == {(f, m, b, i) for m in ("gpt2", "llama") for b in (1, 2)
                     for f in ("torch", "paddle") for i in ("multiattn", "transformers")}  # fmt: skip
    for row in section["rows"]:
        assert row["prompt"] == 8 and row["prefill_ms"] > 0 and row["total_ms"] > 0
        # one repeat of two steps: on a busy machine noise may swamp them (None)
        assert row["tokens_per_s"] is None or row["tokens_per_s"] > 0
    assert "CPU:" in log and "x transformers" in log
    assert _png(png)


def test_importing_the_benchmark_loads_no_framework():
    code = (
        "import sys, multiattn.bench, multiattn.bench.worker, multiattn.bench.long\n"
        "print(sorted(m for m in ('jax', 'torch', 'tensorflow', 'paddle', 'keras') "
        "if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_page_faults_count_the_fresh_pages_a_call_touches():
    from multiattn.bench.common import page_faults_per_call

    def fresh():  # 64 MiB mapped anew on every call, one byte written per 4 KiB
        area = mmap.mmap(-1, 64 << 20)
        view = np.frombuffer(area, dtype=np.uint8)
        view[::4096] = 1
        del view
        area.close()

    kept = np.ones(8 << 20)  # written once here: its pages exist before the calls

    def reused():
        kept.fill(1.0)

    assert page_faults_per_call(fresh) >= 0.9 * (64 << 20) / 4096 / 512  # huge pages or not
    assert page_faults_per_call(reused) < 100


@pytest.mark.parametrize(
    ("value", "text"), [(None, "-"), (0, "0"), (812, "812"), (8192, "8.2k"), (93245.0, "93k")]
)
def test_page_fault_counts_are_printed_in_three_digits(value, text):
    from multiattn.bench.report import _count

    assert _count(value) == text


def test_the_memory_setup_names_the_allocator_variables(monkeypatch):
    from multiattn.bench.common import describe_memory, memory_setup

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    setup = memory_setup()
    assert setup["malloc_env"]["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert "THP_MEM_ALLOC_ENABLE" not in setup["malloc_env"]
    line = describe_memory(setup)
    assert "GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in line
    assert describe_memory({}) == (
        "Memory: transparent huge pages unknown; allocator variables: none set"
    )


def test_the_report_says_when_the_adapters_come_from_another_tree(tmp_path):
    from pathlib import Path

    from multiattn.bench.common import code_origin, describe_code, trees_differ

    here = code_origin()  # mixed only where the environment mixes two trees
    assert Path(here["core"]).name == "multiattn" and here["adapters"] is not None
    assert (describe_code(here) is None) == (not here["mixed"])
    checkout, other = tmp_path / "checkout", tmp_path / "worktree"
    assert not trees_differ(checkout / "multiattn", checkout / "backends")
    assert not trees_differ(checkout / "multiattn", checkout / "multiattn" / "backends")
    assert trees_differ(other / "multiattn", checkout / "backends")
    line = describe_code(
        {"core": str(other / "multiattn"), "adapters": str(checkout / "backends"), "mixed": True}
    )
    assert str(checkout / "backends") in line and str(other / "multiattn") in line


def test_the_bandwidth_bound_and_its_fraction_are_the_hand_computed_ones():
    from rich.console import Console

    from multiattn.bench.decode import bandwidth_bound, print_decode

    # 1.5 GB of weights read once per step at 30 GB/s: 20 steps/s, a token per row each
    assert bandwidth_bound(1_500_000_000, 30.0, 1) == pytest.approx(20.0)
    assert bandwidth_bound(1_500_000_000, 30.0, 8) == pytest.approx(160.0)
    row = {"model": "llama1b", "prompt": 128, "framework": "jax", "prefill_ms": 900.0,
           "total_ms": 5000.0}  # fmt: skip
    section = {
        "config": {"new_tokens": 32, "repeats": 1},
        "bandwidth": {"gb_per_s": 30.0, "bytes": 1 << 30, "threads": 2, "repeats": 7},
        "models": {
            "llama1b": {
                "dtype": "bfloat16",
                "parameters": 750_000_000,
                "weight_bytes": 1_500_000_000,
            }
        },
        "frameworks": {
            "jax": {
                "status": "ran",
                "loads": {
                    "llama1b": {
                        "dtype": "bfloat16",
                        "load_s": 3.0,
                        "rss_added": 1_800_000_000,
                        "peak_added": 2_000_000_000,
                        "first_call_s": 12.0,
                        "transformers": {
                            "load_s": 2.0,
                            "rss_added": 1_600_000_000,
                            "first_call_s": 1.5,
                        },
                    }
                },
            }
        },
        "rows": [
            {**row, "batch": 1, "implementation": "multiattn", "tokens_per_s": 15.0},
            {**row, "batch": 1, "implementation": "transformers", "tokens_per_s": 10.0},
            {**row, "batch": 8, "implementation": "multiattn", "tokens_per_s": 40.0},
            {**row, "batch": 8, "implementation": "transformers", "tokens_per_s": None},
        ],
    }
    console = Console(record=True, width=250)
    print_decode(section, console)
    text = console.export_text()
    assert "Read bandwidth: 30.0 GB/s" in text and "bound 20.0 tokens/s at batch 1" in text
    cells = [[c.strip() for c in ln.split("│")[1:-1]] for ln in text.splitlines() if "│" in ln]
    rates = {(c[2], c[4]): c for c in cells if len(c) == 9 and c[0] == "llama1b"}
    assert rates[("1", "multiattn")][-2:] == ["1.50", "0.75"]  # 15 / 10, 15 / 20
    assert rates[("8", "multiattn")][-2:] == ["", "0.25"]  # no transformers rate; 40 / 160
    assert rates[("8", "transformers")][-3:] == ["noise", "", ""]
    (load,) = [c for c in cells if len(c) == 11 and c[0] == "llama1b"]
    assert load[1:] == ["jax", "bfloat16", "3.0", "1.80", "1.20", "2.00", "12.0", "2.0",
                        "1.60", "1.5"]  # fmt: skip


def test_the_read_bandwidth_is_measured_on_every_thread():
    from multiattn.bench.decode import read_bandwidth

    bw = read_bandwidth(16 << 20, repeats=2, threads=2)
    assert bw["gb_per_s"] > 0 and bw["threads"] == 2 and len(bw["seconds"]) == 2


@pytest.mark.skipif(not _installed("torch"), reason="torch is not installed")
def test_the_weight_bytes_count_tied_embeddings_once():
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from multiattn.bench.decode import weight_bytes

    sizes = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    counts = {}
    for tied in (True, False):
        model = AutoModelForCausalLM.from_config(
            LlamaConfig(tie_word_embeddings=tied, **sizes), dtype=torch.bfloat16
        )
        assert weight_bytes(model) == model.num_parameters() * 2
        counts[tied] = weight_bytes(model)
    assert counts[False] - counts[True] == 300 * 32 * 2  # the head's own copy


@pytest.mark.skipif(not _installed("torch"), reason="torch is not installed")
@pytest.mark.parametrize("name", ["qwen2", "llama1b"])
def test_the_real_bfloat16_models_are_saved_in_bfloat16_and_their_configs_accepted(tmp_path, name):
    pytest.importorskip("transformers")
    import transformers

    from multiattn.bench.decode import KINDS, LLAMA3_ROPE, SIZES, make_model
    from multiattn.hf.causal_lm import CAUSAL_LM_FAMILIES

    info = make_model(tmp_path / name, name, 64, size="small")
    saved = json.loads((tmp_path / name / "config.json").read_text())
    assert info["dtype"] == saved["dtype"] == "bfloat16"
    assert info["weight_bytes"] == info["parameters"] * 2
    # the real shape's config (no weights made) passes multiattn's table of its family
    getattr(transformers, KINDS[name][0])(**SIZES["real"][name]).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    family = next(f for f in CAUSAL_LM_FAMILIES if f.model_type == raw["model_type"])
    sizes = family.check_config(raw, "config.json")
    assert (
        sizes["tied"] and sizes["num_key_value_heads"] == SIZES["real"][name]["num_key_value_heads"]
    )
    if name == "llama1b":
        assert sizes["head_dim"] == 64 and sizes["rope_theta"] == 500000.0
        assert sizes["rope_scaling"]["rope_type"] == LLAMA3_ROPE["rope_type"] == "llama3"


def test_the_decode_models_and_sizes_parse():
    from multiattn.bench.main import build_parser, decode_config

    parser = build_parser()

    def parsed(*argv):
        return decode_config(parser.parse_args(["--decode", *argv]), parser,
                             {"frameworks": ["torch", "numpy"], "seed": 0})  # fmt: skip

    real = parsed("--decode-size", "real")
    assert real["models"] == ["gpt2", "qwen2", "llama1b"]
    assert real["prompts"] == [128, 512] and real["batches"] == [1, 8]
    assert real["new_tokens"] == 32 and real["frameworks"] == ["torch"]
    assert parsed()["models"] == ["gpt2", "llama"]
    chosen = parsed("--decode-size", "real", "--decode-models", "llama1b, qwen2,llama1b")
    assert chosen["models"] == ["llama1b", "qwen2"]
    proc = subprocess.run(
        [sys.executable, "-m", "multiattn.cli", "bench", "--decode", "--decode-models", "llama2"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2 and "gpt2, llama, qwen2, llama1b" in proc.stderr
