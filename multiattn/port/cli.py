"""``multiattn port SRC DST --from FORMAT --to FORMAT``: convert a weight file.

The module structure comes from, in this order: the ``multiattn.kind`` /
``multiattn.config`` metadata of a neutral safetensors file (or of an h5 file written by
this command); else ``--module`` (mha or encoder; Keras ``.weights.h5`` files show it
themselves) with every size read from the tensor shapes, and ``--num-heads`` for the torch
and paddle layouts, whose packed projections do not show the heads. Every tensor must be
accounted for: a missing, extra or mis-shaped tensor stops the run before any tensor data
is read, and nothing is written. With ``--from hf`` / ``--to hf`` (a whole model,
`multiattn.port.models`) the model's config gives the structure: the module flags are
refused, and so is ``--max-size`` with ``--from hf`` (a folder is read whole).

Exit status: 0 on success; 1 when the conversion is refused or fails (the message starts
with ``multiattn port: error:``); 2 for a command line argparse cannot parse; 128 + the
signal number when SIGTERM, SIGINT or SIGHUP stops the run.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

from .checkpoint import (
    DEFAULT_MAX_BYTES,
    FORMATS,
    PICKLE_FORMATS,
    Conversion,
    Interrupted,
    PortError,
    convert_file,
)

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="multiattn port",
        description="Convert attention weights between frameworks' checkpoint files.",
    )
    p.add_argument("src", type=Path, help="source weight file (hf: a model folder)")
    p.add_argument("dst", type=Path, help="destination file or folder (written atomically)")
    p.add_argument("--from", dest="src_fmt", required=True, choices=(*FORMATS, "hf"))
    p.add_argument("--to", dest="dst_fmt", default="safetensors", choices=(*FORMATS, "hf"),
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
    p.add_argument("--rotary-max-length", type=int,
                   help="mha: rotary position embedding for this many positions (metadata)")  # fmt: skip
    p.add_argument("--rotary-base", type=float,
                   help="mha: rotary wavelength base (default 10000; metadata)")  # fmt: skip
    p.add_argument("--max-size", default=None, metavar="SIZE",
                   help="most tensor data to read, e.g. 512M or 8G (default 4G)")  # fmt: skip
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow reading pickle-based files (.pdparams); they can run code")  # fmt: skip
    p.add_argument("--force", action="store_true", help="overwrite DST if it exists")
    return p


def _size(text: str | None) -> int:
    if text is None:
        return DEFAULT_MAX_BYTES
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.I)
    if match is None or float(match.group(1)) <= 0:
        raise PortError(
            f"--max-size must be a positive size such as 512M or 8G; received {text!r}."
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _positive(flag: str, value: float | None, integer: bool) -> None:
    if value is None:
        return
    if not (value > 0 and math.isfinite(value)):
        kind = "integer" if integer else "finite number"
        raise PortError(f"{flag} must be a positive {kind}; received {value!r}.")


def _extra(args: argparse.Namespace) -> dict:
    """The behaviour and settings given as flags (they override the file's metadata)."""
    _positive("--num-heads", args.num_heads, True)
    _positive("--epsilon", args.epsilon, False)
    _positive("--rotary-max-length", args.rotary_max_length, True)
    _positive("--rotary-base", args.rotary_base, False)
    extra: dict = {}
    if args.norm_first is not None:
        extra["norm_first"] = args.norm_first == "true"
    for key in ("epsilon", "activation", "rotary_max_length", "rotary_base"):
        if getattr(args, key) is not None:
            extra[key] = getattr(args, key)
    return extra


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        try:
            return a.resolve() == b.resolve()
        except (OSError, RuntimeError):
            return False


def _check_paths(args: argparse.Namespace) -> None:
    if _same_file(args.src, args.dst):
        raise PortError("SRC and DST are the same file.")
    if args.dst.is_dir():
        raise PortError(f"{args.dst}: is a directory; give a file name.")
    if os.path.lexists(args.dst) and not args.force:
        raise PortError(f"{args.dst} exists; pass --force to replace it.")
    if args.dst_fmt in PICKLE_FORMATS and not args.trust_pickle:
        raise PortError(
            f"--to {args.dst_fmt} writes a pickle, which loads only with code execution "
            "enabled; pass --trust-pickle to write it anyway (safetensors is safer)."
        )
    if args.dst_fmt in ("keras", "keras-mha") and not args.dst.name.endswith(".weights.h5"):
        raise PortError(
            f"{args.dst}: Keras loads weight files only under a name ending in '.weights.h5'."
        )


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


def _error(message: str) -> None:
    print(f"multiattn port: error: {message}", file=sys.stderr)


#: Flags that describe one module; a model's config gives its structure instead.
_MODULE_FLAGS = ("module", "num_heads", "prefix", "norm_first", "epsilon", "activation",
                 "rotary_max_length", "rotary_base")  # fmt: skip


def _model(args: argparse.Namespace) -> int:
    """A whole model folder (`multiattn.port.models`)."""
    from .models import convert_model

    side = "--from hf" if args.src_fmt == "hf" else "--to hf"
    given = [key for key in _MODULE_FLAGS if getattr(args, key) not in (None, "")]
    if given:
        flags = ", ".join("--" + key.replace("_", "-") for key in given)
        verb = "does" if len(given) == 1 else "do"
        raise PortError(
            f"{flags} {verb} not apply to {side}: a model's config gives its structure."
        )
    if args.src_fmt == "hf" and args.max_size is not None:
        raise PortError(
            "--max-size does not apply to --from hf: a model folder is read whole, as "
            "from_pretrained reads it."
        )
    if _same_file(args.src, args.dst):
        raise PortError("SRC and DST are the same.")
    done = convert_model(args.src, args.dst, args.src_fmt, args.dst_fmt, args.trust_pickle,
                         args.force, _size(args.max_size))  # fmt: skip
    for stale in done["removed"]:
        print(f"multiattn port: removed {stale}, left by a killed run.", file=sys.stderr)
    print(f"{args.src} ({args.src_fmt}) -> {args.dst} ({args.dst_fmt}): "
          f"{done['model_type']} model, {done['tensors']} tensors")  # fmt: skip
    return 0


def _convert(args: argparse.Namespace) -> int:
    """One module's weight file (`multiattn.port.checkpoint.convert_file`)."""
    extra = _extra(args)
    max_bytes = _size(args.max_size)
    _check_paths(args)
    conv = convert_file(
        args.src,
        args.dst,
        args.src_fmt,
        args.dst_fmt,
        kind=args.module,
        num_heads=args.num_heads,
        prefix=args.prefix,
        extra_config=extra,
        trust_pickle=args.trust_pickle,
        max_bytes=max_bytes,
    )
    for stale in conv.removed_temp_files or ():
        print(f"multiattn port: removed {stale}, left by a killed run.", file=sys.stderr)
    _report(conv, args)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if "hf" in (args.src_fmt, args.dst_fmt):
            return _model(args)
        return _convert(args)
    except PortError as err:
        _error(f"{err} Nothing was written.")
        return 1
    except Interrupted as err:
        _error(f"{err} Nothing was written.")
        return 128 + err.signum
    except KeyboardInterrupt:
        _error("interrupted. Nothing was written.")
        return 130
    except Exception as err:  # never a traceback: say what failed
        _error(
            f"unexpected {type(err).__name__}: {err} Nothing was written. (This is a bug in "
            "multiattn port; please report it with the command line.)"
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
