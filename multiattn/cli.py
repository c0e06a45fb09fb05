"""The ``multiattn`` command line."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="multiattn", description="Attention identical across frameworks."
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser(
        "demo", help="run the same attention on every installed backend and compare"
    )
    demo.add_argument(
        "--backends", default="jax,torch,tensorflow,numpy", help="comma-separated Keras backends"
    )
    sub.add_parser(
        "conformance",
        help="run the cross-framework conformance suite; --families and --model check whole "
        "models (multiattn conformance --help)",
        add_help=False,
    )
    sub.add_parser(
        "bench", help="time multiattn against each framework's own attention", add_help=False
    )
    sub.add_parser("port", help="convert a weight file between frameworks", add_help=False)
    tune = sub.add_parser(
        "tune",
        help="time the kernel and decoding choices of a model's generate on this machine "
        "and write them to a file (multiattn.tuning.load_decisions reads it)",
    )
    tune.add_argument("model", help="a Hugging Face folder (from_pretrained)")
    tune.add_argument("--backend", choices=("jax", "torch", "tensorflow", "numpy", "paddle"),
                      help="the Keras backend, or paddle (default: KERAS_BACKEND)")  # fmt: skip
    tune.add_argument("--batch", type=positive_int, default=1)
    tune.add_argument("--prompt", type=positive_int, default=128, help="prompt length")
    tune.add_argument("--new-tokens", type=positive_int, default=32)
    tune.add_argument("--out", default="multiattn-tuning.json", help="the file to write")
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["conformance"]:
        if any(a == "--families" or a.startswith("--families=") for a in argv[1:]):
            from multiattn.conformance.families import main as families_main

            return families_main(argv[1:])
        if any(a == "--model" or a.startswith("--model=") for a in argv[1:]):
            from multiattn.conformance.model_check import main as model_check_main

            return model_check_main(argv[1:])
        from multiattn.conformance.runner import main as conformance_main

        return conformance_main(argv[1:])
    if argv[:1] == ["bench"]:
        from multiattn.bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["port"]:
        from multiattn.port.cli import main as port_main

        return port_main(argv[1:])
    args = parser.parse_args(argv)
    if args.version:
        from importlib.metadata import version

        print(version("multiattn"))
        return 0
    if args.command == "demo":
        from . import demo as demo_module

        names = [b.strip() for b in args.backends.split(",") if b.strip()]
        unknown = sorted(set(names) - set(demo_module.BACKENDS))
        if unknown:
            parser.error(f"--backends: unknown backend(s) {', '.join(unknown)}")
        return demo_module.run(names)
    if args.command == "tune":
        return _tune(args)
    parser.print_help()
    return 2


def positive_int(text: str) -> int:
    """An argparse type: a positive integer."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; received {text}")
    return value


def _tune(args: argparse.Namespace) -> int:
    """``multiattn tune``: one greedy ``generate`` of the model with
    ``settings(autotune=True)``, then its decisions written to ``--out``."""
    if args.backend == "paddle":
        import multiattn.paddle  # noqa: F401 - Paddle before anything loads TensorFlow
    elif args.backend is not None:
        if "keras" in sys.modules and os.environ.get("KERAS_BACKEND") != args.backend:
            raise SystemExit("multiattn tune: Keras was imported with another backend.")
        os.environ["KERAS_BACKEND"] = args.backend
    import numpy as np

    from . import config, tuning
    from .models import from_pretrained

    model = from_pretrained(args.model, framework="paddle" if args.backend == "paddle" else None)
    vocab = int(model.config["vocab_size"])
    ids = np.random.default_rng(0).integers(0, vocab, (args.batch, args.prompt))
    with config.settings(autotune=True):
        if hasattr(model, "generate"):
            model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
        else:  # an encoder: its forward pass
            model(input_ids=ids)
    count = tuning.save_decisions(args.out)
    for line in tuning.describe_decisions():
        print(line)
    print(f"{count} decisions written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
