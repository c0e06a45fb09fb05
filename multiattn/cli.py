"""The ``multiattn`` command line."""

from __future__ import annotations

import argparse
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
    sub.add_parser("conformance", help="run the cross-framework conformance suite", add_help=False)
    sub.add_parser(
        "bench", help="time multiattn against each framework's own attention", add_help=False
    )
    sub.add_parser("port", help="convert a weight file between frameworks", add_help=False)
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
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
