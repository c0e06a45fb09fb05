"""``multiattn port SRC DST --from FORMAT --to FORMAT``: convert a weight file.

The module structure comes from, in this order: the ``multiattn.kind`` /
``multiattn.config`` metadata of a neutral safetensors file; else ``--module`` (mha or
encoder; Keras ``.weights.h5`` files show it themselves) with every size read from the
tensor shapes, and ``--num-heads`` for the torch and paddle layouts, whose packed
projections do not show the heads. Every tensor must be accounted for: a missing, extra or
mis-shaped tensor stops the run before anything is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .checkpoint import (
    FORMATS,
    PICKLE_FORMATS,
    Conversion,
    PortError,
    convert_tensors,
    metadata_for,
    read_tensors,
    write_tensors,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="multiattn port",
        description="Convert attention weights between frameworks' checkpoint files.",
    )
    p.add_argument("src", type=Path, help="source weight file")
    p.add_argument("dst", type=Path, help="destination file (written atomically)")
    p.add_argument("--from", dest="src_fmt", required=True, choices=FORMATS)
    p.add_argument("--to", dest="dst_fmt", default="safetensors", choices=FORMATS,
                   help="output format (default: safetensors, the neutral layout)")  # fmt: skip
    p.add_argument("--module", choices=("mha", "encoder"),
                   help="module kind (not needed for multiattn safetensors files)")  # fmt: skip
    p.add_argument("--num-heads", type=int, help="number of heads (torch and paddle layouts)")
    p.add_argument("--prefix", default="",
                   help="convert only tensors whose name starts with PREFIX (stripped)")  # fmt: skip
    p.add_argument("--norm-first", choices=("true", "false"),
                   help="encoder: pre-LayerNorm (recorded in safetensors metadata)")  # fmt: skip
    p.add_argument("--epsilon", type=float, help="encoder: LayerNorm epsilon (metadata)")
    p.add_argument("--activation", choices=("relu", "gelu"), help="encoder: activation")
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow reading pickle-based files (.pdparams); they can run code")  # fmt: skip
    p.add_argument("--force", action="store_true", help="overwrite DST if it exists")
    return p


def _report(conv: Conversion, args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(shape) -> str:
        return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"

    table = Table(title=f"{args.src} ({args.src_fmt}) -> {args.dst} ({args.dst_fmt})")
    for col in ("neutral name", "shape", "dtype", f"from ({args.src_fmt})", f"to ({args.dst_fmt})"):
        table.add_column(col)
    for name, arr in conv.weights.items():
        table.add_row(
            name,
            fmt(arr.shape),
            str(arr.dtype),
            args.prefix + conv.source_names.get(name, name),
            conv.target_names.get(name, name),
        )
    console = Console()
    console.print(table)
    console.print(
        f"{conv.kind}: {len(conv.weights)} neutral tensors mapped to "
        f"{len(conv.target_tensors)} {args.dst_fmt} tensors; config {conv.config}"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.src.resolve() == args.dst.resolve():
            raise PortError("SRC and DST are the same file.")
        if args.dst.exists() and not args.force:
            raise PortError(f"{args.dst} exists; pass --force to replace it.")
        if args.dst_fmt in PICKLE_FORMATS and not args.trust_pickle:
            raise PortError(
                f"--to {args.dst_fmt} writes a pickle, which loads only with code execution "
                "enabled; pass --trust-pickle to write it anyway (safetensors is safer)."
            )
        if args.dst_fmt in ("keras", "keras-mha") and not args.dst.name.endswith(".weights.h5"):
            raise PortError(f"{args.dst}: Keras loads weight files only under a name ending in "
                            "'.weights.h5'.")  # fmt: skip
        tensors, meta = read_tensors(args.src, args.src_fmt, trust_pickle=args.trust_pickle)
        if args.prefix:
            tensors = {
                k[len(args.prefix) :]: v for k, v in tensors.items() if k.startswith(args.prefix)
            }
            if not tensors:
                raise PortError(f"{args.src}: no tensor name starts with {args.prefix!r}.")
        extra = {}
        if args.norm_first is not None:
            extra["norm_first"] = args.norm_first == "true"
        if args.epsilon is not None:
            extra["epsilon"] = args.epsilon
        if args.activation is not None:
            extra["activation"] = args.activation
        conv = convert_tensors(
            tensors, meta, args.src_fmt, args.dst_fmt, args.module, args.num_heads, extra
        )
        metadata = metadata_for(conv.kind, conv.config) if args.dst_fmt == "safetensors" else {}
        write_tensors(args.dst, args.dst_fmt, conv.target_tensors, metadata)
    except PortError as err:
        print(f"multiattn port: error: {err} Nothing was written.", file=sys.stderr)
        return 1
    _report(conv, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
