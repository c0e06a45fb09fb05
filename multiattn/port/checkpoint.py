"""Weight files: reading, mapping to and from the neutral layout, atomic writing.

Formats (``FORMATS``):

``safetensors``
    The neutral layout (`multiattn.port.layout`) in a safetensors file; the metadata
    holds ``multiattn.kind`` and ``multiattn.config`` (JSON), so the file rebuilds its
    module alone. The default output.
``torch-safetensors``
    A safetensors file with ``torch.nn`` ``state_dict`` names.
``torch``
    A ``torch.save``'d ``state_dict`` (``.pt``/``.pth``/``.bin``), read with
    ``torch.load(weights_only=True)``: tensors only, no code runs. A file that needs full
    unpickling is refused.
``paddle``
    A ``paddle.save``'d ``state_dict`` (``.pdparams``). It is a pickle, which can run code
    when read: refused unless ``trust_pickle=True``. Needs paddle.
``keras``
    A ``.weights.h5`` file of `multiattn.layers.MultiHeadAttention` or
    ``TransformerEncoderLayer`` (read and written with h5py; no TensorFlow). Files written
    here carry ``multiattn.kind`` and ``multiattn.config`` as attributes of the root group.
``keras-mha``
    A ``.weights.h5`` file of ``keras.layers.MultiHeadAttention``.

Reading is in two steps. `open_tensors` reads what a file declares (names, shapes, dtypes,
metadata) without reading tensor data; the module kind and config follow from the
metadata or the declared shapes, every expected tensor is checked against them, and only
then are the expected tensors read, up to a total size (``max_bytes``). HDF5 files must
hold their data themselves: external storage, virtual datasets, soft and external links
are refused.

Every file is written to a temporary file ``.DST.multiattn-port.HOST.PID.XXXXXXXX.tmp`` in
the destination's directory and moved into place with ``os.replace``: an interrupted run
leaves the old file or none, never half a file. SIGTERM, SIGINT and SIGHUP during the
write remove the temporary file (`Interrupted`); a run killed outright (SIGKILL) cannot,
and the next write to the same destination on the same host removes such leftovers whose
process is gone.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import re
import signal
import socket
import stat
import tempfile
import threading
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .layout import (
    KINDS,
    PortableWeights,
    _fmt,
    check_config,
    check_weights,
    encoder_attention_config,
    expected_shapes,
    refuse_settings,
    structure,
)
from .names import (
    framework_shapes,
    infer_config,
    neutral_to_paddle,
    neutral_to_torch,
    paddle_to_neutral,
    torch_packed,
    torch_to_neutral,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "FORMATS",
    "Interrupted",
    "PortError",
    "Spec",
    "TensorSource",
    "convert_file",
    "convert_tensors",
    "load_portable",
    "open_tensors",
    "read_tensors",
    "remove_stale_temp_files",
    "save_portable",
    "stale_temp_files",
    "write_tensors",
]

FORMATS = ("safetensors", "torch-safetensors", "torch", "paddle", "keras", "keras-mha")
PICKLE_FORMATS = ("paddle",)
# format -> the name layout of its tensors
LAYOUT = {
    "safetensors": "neutral",
    "torch-safetensors": "torch",
    "torch": "torch",
    "paddle": "paddle",
    "keras": "keras",
    "keras-mha": "keras-mha",
}
META_KIND, META_CONFIG = "multiattn.kind", "multiattn.config"
#: Formats whose files carry the kind and config (safetensors metadata, h5 root attributes).
METADATA_FORMATS = ("safetensors", "keras", "keras-mha")

#: The most tensor data (bytes) one conversion reads, unless told otherwise.
DEFAULT_MAX_BYTES = 4 * 2**30
#: The longest ``multiattn.config`` metadata accepted (characters).
MAX_METADATA_CHARS = 65536
#: The most links an HDF5 file may hold.
MAX_H5_LINKS = 10_000
FLOAT_DTYPES = ("float16", "float32", "float64")
#: Marks the temporary files of this module: ``.DST.multiattn-port.HOST.PID.XXXXXXXX.tmp``.
TEMP_TAG = "multiattn-port"


class PortError(ValueError):
    """A checkpoint cannot be converted (missing, extra or mis-shaped tensors, an unsafe
    or unreadable file). Nothing is written."""


class Interrupted(Exception):
    """A signal (SIGTERM, SIGINT, SIGHUP) stopped a write; the temporary file is removed
    and the destination is untouched."""

    def __init__(self, signum: int, what: str = "file"):
        self.signum = int(signum)
        name = signal.Signals(self.signum).name
        super().__init__(f"interrupted by {name} while writing; the temporary {what} was removed.")


def _brief(err: BaseException, limit: int = 300) -> str:
    """``Type: first sentence of the message`` (framework messages run to paragraphs)."""
    text = " ".join(str(err).split())
    cut = text.find(". ")
    if 0 < cut < limit:
        text = text[: cut + 1]
    elif len(text) > limit:
        text = text[:limit] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


# --- what a file declares ---------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """What a file declares about one tensor: its shape and dtype name (the source's own
    name, e.g. ``bfloat16``, where NumPy has none)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        try:
            itemsize = np.dtype(self.dtype).itemsize
        except TypeError:
            itemsize = 8
        return math.prod(self.shape) * itemsize

    @classmethod
    def of(cls, name: str, value: Any) -> Spec:
        if not isinstance(value, np.ndarray):
            raise PortError(f"tensor {name!r} must be a NumPy array; received {type(value)}.")
        return cls(tuple(int(d) for d in value.shape), value.dtype.name)


def _native(arr: np.ndarray) -> np.ndarray:
    """``arr`` in native byte order (h5 and pickles may hold big-endian data)."""
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))


class TensorSource:
    """An open weight file: ``specs`` (name -> `Spec`) and ``metadata``, read without
    reading tensor data; `load` reads the named tensors. Use as a context manager."""

    def __init__(
        self,
        path: Path,
        specs: dict[str, Spec],
        metadata: dict,
        load: Callable[[str], Any],
        close: Callable[[], None] | None = None,
    ):
        self.path, self.specs, self.metadata = path, specs, metadata
        self._load, self._close = load, close

    def load(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        """The tensors ``names`` as NumPy arrays of the declared shapes and dtypes."""
        out = {}
        for name in names:
            spec = self.specs[name]
            try:
                arr = np.asarray(self._load(name))
            except PortError:
                raise
            except Exception as err:
                raise PortError(
                    f"{self.path}: cannot read tensor {name!r} ({_brief(err)})."
                ) from None
            if tuple(arr.shape) != spec.shape or arr.dtype.name != spec.dtype:
                raise PortError(
                    f"{self.path}: tensor {name!r} was declared {_fmt(spec.shape)} {spec.dtype} "
                    f"but reads as {_fmt(arr.shape)} {arr.dtype.name}."
                )
            out[name] = _native(arr)
        return out

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_ST_DTYPES = {
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "BF16": "bfloat16",
    "BOOL": "bool",
    **{f"I{b}": f"int{b}" for b in (8, 16, 32, 64)},
    **{f"U{b}": f"uint{b}" for b in (8, 16, 32, 64)},
}


def _open_safetensors(path: Path) -> TensorSource:
    from safetensors import safe_open

    stack = contextlib.ExitStack()
    try:
        fh = stack.enter_context(safe_open(str(path), framework="numpy"))
        meta = fh.metadata() or {}
        specs = {}
        for key in fh.keys():
            sl = fh.get_slice(key)
            dtype = sl.get_dtype()
            specs[key] = Spec(tuple(int(d) for d in sl.get_shape()), _ST_DTYPES.get(dtype, dtype))
    except Exception as err:
        stack.close()
        raise PortError(f"{path}: not a readable safetensors file ({_brief(err)}).") from None
    return TensorSource(path, specs, dict(meta), fh.get_tensor, stack.close)


def _needs_pickle(text: str) -> bool:
    """Whether torch's weights-only loader refused a well-formed pickle for the classes it
    names (rather than a corrupt file)."""
    return "Unsupported global" in text or "can still be loaded" in text


def _torch_load_error(path: Path, err: Exception) -> PortError:
    text = str(err)
    if _needs_pickle(text):
        return PortError(
            f"{path}: not a plain state_dict of tensors (it needs full unpickling: "
            f"{_unpickler_detail(text)}). Reading a full pickle can run arbitrary code; pass "
            "--trust-pickle (trust_pickle=True) only for files you trust."
        )
    if isinstance(err, pickle.UnpicklingError) and "WeightsUnpickler error" in text:
        detail = _unpickler_detail(text)
    elif isinstance(err, EOFError):
        detail = "the file ends early"
    else:
        detail = _brief(err)
    return PortError(f"{path}: not a readable torch file ({detail}).")


def _unpickler_detail(text: str) -> str:
    """The reason inside torch's weights-only message, without its advice to disable
    the weights-only loader."""
    match = re.search(r"WeightsUnpickler error:\s*(.*?)(?:\n\n|$)", text, re.S)
    detail = " ".join((match.group(1) if match else text).split())
    return detail[:300] or "malformed pickle"


def _open_torch(path: Path, trust_pickle: bool, max_bytes: int) -> TensorSource:
    import torch

    is_zip = zipfile.is_zipfile(path)
    if not is_zip:
        _check_file_size(path, max_bytes, "a torch file in the legacy (non-zip) format")
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=is_zip)
    except Exception as err:
        if not (trust_pickle and _needs_pickle(str(err))):
            raise _torch_load_error(path, err) from None
        try:
            obj = torch.load(str(path), map_location="cpu", weights_only=False, mmap=is_zip)
        except Exception as err2:
            raise PortError(f"{path}: not a readable torch file ({_brief(err2)}).") from None
    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict()
    if not isinstance(obj, dict):
        raise PortError(f"{path}: expected a state_dict (a dict of tensors); got {type(obj)}.")
    specs = {}
    for key, value in obj.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise PortError(
                f"{path}: expected a state_dict (a dict of tensors); entry {key!r:.80} is "
                f"{type(value).__name__}."
            )
        specs[key] = Spec(tuple(int(d) for d in value.shape), str(value.dtype).split(".")[-1])

    def load(name: str) -> np.ndarray:
        # a copy: the tensors of a memory-mapped file are views of it
        return np.array(obj[name].detach().cpu().numpy())

    return TensorSource(path, specs, {}, load)


def _check_file_size(path: Path, max_bytes: int, what: str) -> None:
    size = path.stat().st_size
    if size > max_bytes:
        raise PortError(
            f"{path}: {what} is read whole; it has {size} bytes, more than the limit of "
            f"{max_bytes} (--max-size)."
        )


def _open_paddle(path: Path, trust_pickle: bool, max_bytes: int) -> TensorSource:
    if not trust_pickle:
        raise PortError(
            f"{path}: .pdparams files are Python pickles, and reading a pickle can run "
            "arbitrary code. Pass --trust-pickle (trust_pickle=True) only for files you trust."
        )
    _check_file_size(path, max_bytes, "a .pdparams pickle")
    import paddle

    try:
        obj = paddle.load(str(path), return_numpy=True)
    except Exception as err:
        raise PortError(f"{path}: paddle.load failed ({_brief(err)}).") from None
    if not isinstance(obj, dict):
        raise PortError(f"{path}: expected a state_dict; got {type(obj).__name__}.")
    specs = {}
    for key, value in obj.items():
        if not isinstance(key, str) or not isinstance(value, np.ndarray):
            raise PortError(
                f"{path}: expected a state_dict (a dict of arrays); entry {key!r:.80} is "
                f"{type(value).__name__}."
            )
        specs[key] = Spec(tuple(int(d) for d in value.shape), value.dtype.name)
    return TensorSource(path, specs, {}, obj.__getitem__)


def _h5_metadata(path: Path, fh: Any) -> dict[str, str]:
    """The ``multiattn.*`` attributes of the root group: fixed-length byte strings of at
    most `MAX_METADATA_CHARS` (checked before they are read)."""
    import h5py

    meta = {}
    for key in (META_KIND, META_CONFIG):
        if key not in fh.attrs:
            continue
        aid = h5py.h5a.open(fh.id, key.encode())
        dtype, size = aid.dtype, aid.get_storage_size()
        if dtype.kind != "S" or aid.shape != () or size > MAX_METADATA_CHARS:
            raise PortError(
                f"{path}: attribute {key!r} must be a fixed-length byte string of at most "
                f"{MAX_METADATA_CHARS} bytes; received dtype {dtype}, shape {aid.shape}, "
                f"{size} bytes."
            )
        raw = fh.attrs[key]
        try:
            meta[key] = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise PortError(f"{path}: attribute {key!r} is not UTF-8 text.") from None
    return meta


def _h5_specs(path: Path, fh: Any) -> dict[str, Spec]:
    """Every dataset's shape and dtype, from the file's metadata only. Refuses anything that
    reads other files or is not plain data: soft and external links, external storage,
    virtual datasets, named datatypes, and more than `MAX_H5_LINKS` links."""
    import h5py

    specs: dict[str, Spec] = {}
    problems: list[str] = []
    count = 0

    def visit(name: str, link: Any) -> bool | None:
        nonlocal count
        count += 1
        if count > MAX_H5_LINKS:
            problems.append(f"more than {MAX_H5_LINKS} links")
        elif isinstance(link, h5py.SoftLink):
            problems.append(f"{name!r} is a soft link (to {link.path!r})")
        elif isinstance(link, h5py.ExternalLink):
            problems.append(f"{name!r} is an external link (to {link.path!r} in {link.filename!r})")
        elif not isinstance(link, h5py.HardLink):
            problems.append(f"{name!r} is a {type(link).__name__}")
        else:
            obj = fh[name]
            if isinstance(obj, h5py.Group):
                return None
            if not isinstance(obj, h5py.Dataset):
                problems.append(f"{name!r} is a {type(obj).__name__}, not a group or dataset")
            elif obj.is_virtual:
                problems.append(f"dataset {name!r} is virtual (its data lives in other files)")
            elif obj.external or obj.id.get_create_plist().get_external_count():
                files = sorted({str(entry[0]) for entry in obj.external or ()})
                problems.append(f"dataset {name!r} has external storage (in {files})")
            elif obj.shape is None:
                problems.append(f"dataset {name!r} has no dataspace")
            else:
                specs[name] = Spec(tuple(int(d) for d in obj.shape), obj.dtype.name)
                return None
        return True  # stop the visit

    fh.visititems_links(visit)
    if problems:
        raise PortError(
            f"{path}: refused: {problems[0]}. Weight files must hold their data themselves "
            "(no links, external storage or virtual datasets)."
        )
    return specs


def _open_h5(path: Path) -> TensorSource:
    import h5py

    try:
        fh = h5py.File(str(path), "r")
    except Exception as err:
        raise PortError(f"{path}: not a readable HDF5 file ({_brief(err)}).") from None
    try:
        specs = _h5_specs(path, fh)
        meta = _h5_metadata(path, fh)
    except PortError:
        fh.close()
        raise
    except Exception as err:
        fh.close()
        raise PortError(f"{path}: not a readable HDF5 file ({_brief(err)}).") from None
    return TensorSource(path, specs, meta, lambda name: fh[name][()], fh.close)


def _check_source_path(path: Path) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise PortError(f"{path}: no such file.") from None
    except OSError as err:
        raise PortError(f"{path}: cannot read ({err.strerror or _brief(err)}).") from None
    if stat.S_ISDIR(st.st_mode):
        raise PortError(f"{path}: is a directory, not a weight file.")
    if not stat.S_ISREG(st.st_mode):
        raise PortError(f"{path}: not a regular file.")
    try:
        with open(path, "rb"):
            pass
    except OSError as err:
        raise PortError(f"{path}: cannot read ({err.strerror or _brief(err)}).") from None


def open_tensors(
    path: str | os.PathLike,
    fmt: str,
    trust_pickle: bool = False,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> TensorSource:
    """Open a weight file: what it declares (names, shapes, dtypes, metadata), no tensor
    data read yet (pickle formats excepted: they are read whole, up to ``max_bytes``)."""
    path = Path(path)
    if fmt not in FORMATS:
        raise PortError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}.")
    _check_source_path(path)
    needs = {"torch": "torch", "paddle": "paddle", "keras": "h5py", "keras-mha": "h5py"}
    try:
        if fmt in ("safetensors", "torch-safetensors"):
            return _open_safetensors(path)
        if fmt == "torch":
            return _open_torch(path, trust_pickle, max_bytes)
        if fmt == "paddle":
            return _open_paddle(path, trust_pickle, max_bytes)
        return _open_h5(path)
    except ImportError as err:
        raise PortError(f"reading {fmt} files needs {needs.get(fmt, err.name)} ({err}).") from None


def read_tensors(
    path: str | os.PathLike,
    fmt: str,
    trust_pickle: bool = False,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> tuple[dict, dict]:
    """The tensors (name -> NumPy array, names as stored) and metadata of a weight file,
    all of them (at most ``max_bytes`` in all)."""
    with open_tensors(path, fmt, trust_pickle, max_bytes) as source:
        _check_total(source.specs, max_bytes, str(path))
        return source.load(list(source.specs)), source.metadata


def _check_total(specs: dict[str, Spec], max_bytes: int, where: str) -> None:
    total = sum(spec.nbytes for spec in specs.values())
    if total > max_bytes:
        raise PortError(
            f"{where}: the tensors to read hold {total} bytes, more than the limit of "
            f"{max_bytes} (--max-size)."
        )


# --- writing ----------------------------------------------------------------------------


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:32] or "host"


def _temp_prefix(path: Path) -> str:
    """``.NAME.multiattn-port.`` with NAME cut so that a whole temporary name fits in 255
    bytes (room for a 32-character host, a 10-digit pid and mkstemp's 8 characters)."""
    room = 255 - len(f"..{TEMP_TAG}..{'x' * 32}.{'9' * 10}.{'x' * 8}.tmp")
    name = os.fsencode(path.name)[:room].decode("utf-8", "ignore")
    return f".{name}.{TEMP_TAG}."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # exists (another user's), or not a pid we can judge: keep the file
    return True


def stale_temp_files(path: str | os.PathLike) -> list[Path]:
    """Temporary files left next to ``path`` by writes of this module that were killed:
    regular files of this user named for ``path``, this host, and a process that no longer
    exists."""
    path = Path(path)
    prefix, host = _temp_prefix(path), _host()
    pattern = re.compile(r"([A-Za-z0-9-]+)\.(\d{1,10})\.[A-Za-z0-9_]+\.tmp")
    found = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return []
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        match = pattern.fullmatch(entry.name[len(prefix) :])
        if match is None or match.group(1) != host:
            continue
        pid = int(match.group(2))
        if pid == os.getpid() or _alive(pid):
            continue
        try:
            st = os.lstat(entry.path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            found.append(Path(entry.path))
    return sorted(found)


def remove_stale_temp_files(path: str | os.PathLike) -> list[Path]:
    """Remove `stale_temp_files` of ``path``; returns those removed."""
    removed = []
    for stale in stale_temp_files(path):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
            removed.append(stale)
    return removed


_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name)
)


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[dict]:
    """While active, SIGTERM/SIGINT/SIGHUP raise `Interrupted` (so that ``finally`` blocks
    run) until ``state["done"]`` is set; a signal after that is delivered again, to the
    previous handler, on exit. Only in the main thread (Python runs handlers there)."""
    state: dict = {"done": False, "pending": None}
    if threading.current_thread() is not threading.main_thread():
        yield state
        return

    def handler(signum: int, frame: Any) -> None:
        if state["done"]:
            state["pending"] = signum
            return
        raise Interrupted(signum)

    previous = {}
    try:
        for sig in _SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:  # keep what nohup ignores
                previous[sig] = signal.signal(sig, handler)
        yield state
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if state["pending"] is not None:
            signal.raise_signal(state["pending"])


@contextlib.contextmanager
def _atomic(path: Path) -> Iterator[Path]:
    """Yields a temporary path next to ``path``; moved onto ``path`` only on success."""
    with _signals_interrupt() as state:
        path.parent.mkdir(parents=True, exist_ok=True)
        prefix = f"{_temp_prefix(path)}{_host()}.{os.getpid()}."
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
        try:
            os.close(fd)
            yield Path(tmp)
            # mkstemp creates 0600; give the file the mode a plain open() would (or the old
            # one's)
            if path.exists():
                mode = path.stat().st_mode & 0o777
            else:
                umask = os.umask(0)
                os.umask(umask)
                mode = 0o666 & ~umask
            os.chmod(tmp, mode)
            os.replace(tmp, path)
            state["done"] = True
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)


def _write_h5(path: Path, tensors: dict, metadata: dict) -> None:
    import h5py

    with h5py.File(str(path), "w") as fh:
        for key, value in (metadata or {}).items():
            fh.attrs.create(key, np.bytes_(value.encode("utf-8")))
        for name, arr in tensors.items():
            group, _, _ = name.rpartition("/")
            grp = fh.require_group(group)
            grp.attrs.setdefault("name", group.split("/")[-2] if "/" in group else "layer")
            grp.create_dataset(name.rpartition("/")[2], data=arr)


def _check_parent(path: Path) -> None:
    """The nearest existing folder above ``path`` must be a folder (the missing ones are
    made): a file there is named, instead of the operating system's "File exists"."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise PortError(f"{path}: cannot write: {parent} is a file, not a folder.")


def write_tensors(path: str | os.PathLike, fmt: str, tensors: dict, metadata: dict) -> list[Path]:
    """Write ``tensors`` atomically in format ``fmt`` (``metadata``: safetensors metadata,
    or root attributes of h5 files; ignored by the pickle formats).

    Returns the stale temporary files of earlier, killed writes to ``path`` that were
    removed first (see `stale_temp_files`). Raises PortError when the file cannot be
    written, `Interrupted` when a signal stops the write."""
    path = Path(path)
    if fmt not in FORMATS:
        raise PortError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}.")
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    _check_parent(path)
    removed = remove_stale_temp_files(path)
    try:
        with _atomic(path) as tmp:
            if fmt in ("safetensors", "torch-safetensors"):
                from safetensors.numpy import save_file

                save_file(arrays, str(tmp), metadata=metadata or None)
            elif fmt == "torch":
                import torch

                torch.save({k: torch.from_numpy(v) for k, v in arrays.items()}, str(tmp))
            elif fmt == "paddle":
                import paddle

                paddle.save({k: paddle.to_tensor(v) for k, v in arrays.items()}, str(tmp))
            else:
                _write_h5(tmp, arrays, metadata)
    except (Interrupted, KeyboardInterrupt, PortError):
        raise
    except OSError as err:
        raise PortError(f"{path}: cannot write ({err.strerror or _brief(err)}).") from None
    except Exception as err:
        raise PortError(f"{path}: cannot write ({_brief(err)}).") from None
    return removed


# --- name layouts -----------------------------------------------------------------------

_MHA_ORDER = ("query", "key", "value", "output")


def _h5_table(layout: str, kind: str, use_bias: bool) -> dict[str, str]:
    """neutral name -> h5 dataset path, for the Keras layouts: ``keras`` and
    ``keras-mha`` (the projections in ``EinsumDense`` sublayers ``query_dense`` ..
    ``output_dense``, as Keras' ``MultiHeadAttention`` and multiattn's since the drop-in
    hold them) and ``keras-flat`` (multiattn before the drop-in: the layer's own
    variables, all kernels then all biases; read only)."""
    if layout == "keras-mha" and kind != "mha":
        raise PortError(f"keras-mha files hold keras.layers.MultiHeadAttention, not {kind}.")
    if kind not in ("mha", "encoder"):
        raise PortError(f"keras files of kind {kind!r} are not supported.")

    def mha(prefix: str, bias: bool) -> dict[str, str]:
        parts = ("kernel", "bias") if bias else ("kernel",)
        if layout != "keras-flat":
            return {
                f"{prefix}{n}/{part}": f"{prefix}{n}_dense/vars/{i}"
                for n in _MHA_ORDER
                for i, part in enumerate(parts)
            }
        names = [f"{n}/{part}" for part in parts for n in _MHA_ORDER]
        return {f"{prefix}{n}": f"{prefix}vars/{i}" for i, n in enumerate(names)}

    if kind == "mha":
        return mha("", use_bias)
    table = mha("attention/", True)
    for n in ("ffn_1", "ffn_2"):
        table.update({f"{n}/kernel": f"{n}/vars/0", f"{n}/bias": f"{n}/vars/1"})
    for n in ("norm_1", "norm_2"):
        table.update({f"{n}/gamma": f"{n}/vars/0", f"{n}/beta": f"{n}/vars/1"})
    return table


def source_layout(fmt: str, names: Iterable[str]) -> str:
    """The name layout of a ``fmt`` file holding tensors ``names``: `LAYOUT`, except that
    a ``keras`` file written before the drop-in (flat ``vars/N`` of the attention layer)
    reads as ``keras-flat``."""
    names = set(names)
    if fmt == "keras" and ("vars/0" in names or "attention/vars/0" in names):
        return "keras-flat"
    return LAYOUT[fmt]


#: Layouts of HDF5 files (Keras ``.weights.h5``).
_H5_LAYOUTS = ("keras", "keras-mha", "keras-flat")


def _h5_kind_and_bias(
    layout: str, names: Iterable[str], kind: str | None, config: dict | None
) -> tuple[str, bool]:
    names = set(names)
    if kind is None:
        kind = "encoder" if any(k.startswith("attention/") for k in names) else "mha"
    if kind == "encoder":
        return kind, True
    if config is not None and isinstance(config.get("use_bias"), bool):
        return kind, config["use_bias"]
    if layout == "keras-flat":
        return kind, "vars/4" in names
    return kind, "query_dense/vars/1" in names


def _stored_shapes(layout: str, kind: str, config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a ``layout`` file of a ``kind`` module with ``config`` holds, under its
    stored name, with its shape."""
    shapes = expected_shapes(kind, structure(kind, config))
    if layout == "neutral":
        return shapes
    if layout in _H5_LAYOUTS:
        table = _h5_table(layout, kind, kind == "encoder" or config["use_bias"])
        return {table[name]: shape for name, shape in shapes.items()}
    return framework_shapes(layout, kind, structure(kind, config))


def check_specs(expected: dict[str, tuple[int, ...]], specs: dict[str, Spec], where: str) -> None:
    """What a file declares against what the module needs: nothing missing, nothing extra,
    every shape equal, every dtype float16/32/64. Raises PortError naming the tensor."""
    missing = [k for k in expected if k not in specs]
    extra = sorted(k for k in specs if k not in expected)
    if missing or extra:
        parts = [f"missing {missing}"] * bool(missing) + [f"unexpected {extra}"] * bool(extra)
        raise PortError(f"{where}: {'; '.join(parts)}.")
    for name, shape in expected.items():
        spec = specs[name]
        if spec.shape != tuple(shape):
            raise PortError(
                f"{where}: weight {name!r} must have shape {_fmt(shape)}; received "
                f"{_fmt(spec.shape)}."
            )
        if spec.dtype not in FLOAT_DTYPES:
            hint = " (NumPy has no bfloat16: convert the file to float32 first)" * (
                spec.dtype == "bfloat16"
            )
            raise PortError(
                f"{where}: weight {name!r} must be float16, float32 or float64; received "
                f"dtype {spec.dtype}{hint}."
            )


def parse_metadata(metadata: dict) -> tuple[str | None, dict | None]:
    """The kind and config a file's ``multiattn.*`` metadata records (None where absent).
    The config is parsed, not yet checked. Raises PortError for malformed metadata."""
    if META_KIND not in metadata:
        if META_CONFIG in metadata:
            raise PortError(f"the file's metadata has {META_CONFIG!r} but no {META_KIND!r}.")
        return None, None
    kind = metadata[META_KIND]
    if not isinstance(kind, str) or kind not in KINDS:
        raise PortError(
            f"the file's metadata {META_KIND!r} must be one of {', '.join(KINDS)}; received "
            f"{kind!r:.80}."
        )
    if META_CONFIG not in metadata:
        return kind, None
    return kind, metadata_object(metadata, META_CONFIG)


def metadata_object(metadata: dict, key: str) -> dict:
    """The JSON object in ``metadata[key]`` (a text of at most `MAX_METADATA_CHARS`).
    Raises PortError naming the key when it is absent, too long, not JSON or not an
    object."""
    raw = metadata.get(key)
    if raw is None:
        raise PortError(f"the file's metadata has no {key!r}.")
    if not isinstance(raw, str) or len(raw) > MAX_METADATA_CHARS:
        raise PortError(
            f"the file's metadata {key!r} must be a JSON text of at most "
            f"{MAX_METADATA_CHARS} characters; received {type(raw).__name__} of length "
            f"{len(raw) if isinstance(raw, str) else '?'}."
        )
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise PortError(f"the file's metadata {key!r} is not valid JSON ({err}).") from None
    if not isinstance(value, dict):
        raise PortError(
            f"the file's metadata {key!r} must be a JSON object; received "
            f"{type(value).__name__}: {raw:.80}."
        )
    return value


_ENCODER_ONLY = ("norm_first", "epsilon", "activation")
_MHA_ONLY = ("rotary_max_length", "rotary_base")


def _with_extra(kind: str, config: dict, extra: dict | None) -> dict:
    """``config`` with the behaviour and settings given on the command line."""
    if not extra:
        return config
    wrong = _MHA_ONLY if kind == "encoder" else _ENCODER_ONLY
    given = [k for k in wrong if k in extra]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        applies = "mha" if kind == "encoder" else "encoder"
        raise PortError(f"{flags} apply to {applies} files only; this file holds {kind}.")
    return check_config(kind, {**config, **extra})


def resolve(
    layout: str,
    specs: dict[str, Spec],
    metadata: dict,
    kind: str | None = None,
    num_heads: int | None = None,
    extra_config: dict | None = None,
    where: str = "file",
) -> tuple[str, dict, dict, dict[str, tuple[int, ...]]]:
    """From what a file declares, before any tensor is read: ``(kind, config, out_config,
    expected)``: the module kind, its config as read (metadata, or the declared shapes),
    the config with ``extra_config`` applied, and the stored name -> shape of every tensor
    the file must hold. Every declared tensor is checked against ``expected``.

    Raises PortError (missing, extra, mis-shaped or non-float tensors, bad metadata)."""
    try:
        meta_kind, config = parse_metadata(metadata)
        if meta_kind is not None:
            if kind is not None and kind != meta_kind:
                raise PortError(
                    f"--module {kind} contradicts the file's metadata kind {meta_kind!r}."
                )
            kind = meta_kind
        if config is None and num_heads is None and layout in ("torch", "paddle"):
            raise PortError(f"--num-heads is required to read a {layout} layout.")
        if layout in _H5_LAYOUTS:
            kind, bias = _h5_kind_and_bias(layout, specs, kind, config)
            table = _h5_table(layout, kind, bias)
            view = {name: specs[stored] for name, stored in table.items() if stored in specs}
            infer_layout, stored = "neutral", table
        else:
            view, infer_layout, stored = specs, layout, None
        if kind is None:
            raise PortError("the module kind is unknown: pass --module (mha or encoder).")
        if config is None:
            config = infer_config(infer_layout, kind, view, num_heads, stored)
        config = check_config(kind, config)
        expected = _stored_shapes(layout, kind, config)
        check_specs(expected, specs, f"{where} ({layout} {kind})")
        return kind, config, _with_extra(kind, config, extra_config), expected
    except PortError:
        raise
    except (ValueError, TypeError) as err:
        raise PortError(str(err)) from None


def _map_to_neutral(
    layout: str, kind: str, config: dict, tensors: dict
) -> tuple[dict, dict[str, str]]:
    """Checked ``tensors`` of ``layout`` as (neutral weights, neutral -> source name)."""
    shape_config = structure(kind, config)
    try:
        if layout in _H5_LAYOUTS:
            table = _h5_table(layout, kind, kind == "encoder" or config["use_bias"])
            weights = {name: tensors[stored] for name, stored in table.items()}
            weights = check_weights(expected_shapes(kind, shape_config), weights, f"{kind} file")
            return weights, table
        if layout == "neutral":
            weights = check_weights(expected_shapes(kind, shape_config), tensors, f"{kind} file")
            return weights, {k: k for k in weights}
        convert = torch_to_neutral if layout == "torch" else paddle_to_neutral
        return convert(kind, tensors, shape_config), framework_names(layout, kind, shape_config)
    except PortError:
        raise
    except (ValueError, TypeError) as err:
        raise PortError(str(err)) from None


def from_neutral(layout: str, kind: str, config: dict, weights: dict) -> tuple[dict, dict]:
    """Neutral weights as (tensors of ``layout``, neutral -> target name). Refuses a
    config with settings the layout's module cannot represent (naming the setting)."""
    shape_config = structure(kind, config)
    try:
        if layout == "neutral":
            return dict(weights), {k: k for k in weights}
        if layout == "keras-mha":
            what = "keras.layers.MultiHeadAttention (the keras-mha format)"
            refuse_settings("--to keras-mha", what, kind, config, files=True)
        if layout in _H5_LAYOUTS:
            table = _h5_table(layout, kind, kind == "encoder" or config.get("use_bias", True))
            return {table[k]: v for k, v in weights.items()}, table
        convert = neutral_to_torch if layout == "torch" else neutral_to_paddle
        return convert(kind, weights, shape_config), framework_names(layout, kind, shape_config)
    except PortError:
        raise
    except (ValueError, TypeError) as err:
        raise PortError(str(err)) from None


def framework_names(layout: str, kind: str, config: dict) -> dict[str, str]:
    """neutral name -> where it lives in the torch or paddle layout (for reports)."""
    if kind == "encoder":
        inner = framework_names(layout, "mha", encoder_attention_config(config))
        out = {f"attention/{k}": f"self_attn.{v}" for k, v in inner.items()}
        t = {"ffn_1": "linear1", "ffn_2": "linear2", "norm_1": "norm1", "norm_2": "norm2"}
        for n, p in t.items():
            a, b = ("kernel", "bias") if n.startswith("ffn") else ("gamma", "beta")
            out[f"{n}/{a}"] = f"{p}.weight" + (".T" if layout == "torch" and a == "kernel" else "")
            out[f"{n}/{b}"] = f"{p}.bias"
        return out
    e, names = config["query_width"], {}
    for i, n in enumerate(("query", "key", "value")):
        if layout == "paddle":
            names[f"{n}/kernel"] = f"{n[0]}_proj.weight"
            names[f"{n}/bias"] = f"{n[0]}_proj.bias"
        else:
            rows = f"[{i * e}:{(i + 1) * e}]"
            packed = torch_packed(config)
            names[f"{n}/kernel"] = f"in_proj_weight{rows}.T" if packed else f"{n[0]}_proj_weight.T"
            names[f"{n}/bias"] = f"in_proj_bias{rows}"
    names["output/kernel"] = "out_proj.weight" + (".T" if layout == "torch" else "")
    names["output/bias"] = "out_proj.bias"
    if not config["use_bias"]:
        names = {k: v for k, v in names.items() if not k.endswith("/bias")}
    return names


# --- whole conversions ------------------------------------------------------------------


@dataclass
class Conversion:
    """The result of `convert_tensors` / `convert_file`: the neutral weights and the
    per-tensor mapping. ``config`` is the output's config (command-line settings
    applied)."""

    kind: str
    config: dict
    weights: dict
    source_names: dict[str, str]
    target_names: dict[str, str]
    target_tensors: dict
    removed_temp_files: list[Path] | None = None


def _convert(
    arrays: dict, src_layout: str, dst_fmt: str, kind: str, config: dict, out_config: dict
) -> Conversion:
    weights, src_names = _map_to_neutral(src_layout, kind, config, arrays)
    out, dst_names = from_neutral(LAYOUT[dst_fmt], kind, out_config, weights)
    return Conversion(kind, out_config, weights, src_names, dst_names, out)


def convert_tensors(
    tensors: dict,
    metadata: dict,
    src_fmt: str,
    dst_fmt: str,
    kind: str | None = None,
    num_heads: int | None = None,
    extra_config: dict | None = None,
) -> Conversion:
    """Map the tensors of a ``src_fmt`` file to ``dst_fmt`` names (no file written)."""
    if src_fmt not in FORMATS or dst_fmt not in FORMATS:
        raise PortError(f"formats must be among {', '.join(FORMATS)}.")
    specs = {name: Spec.of(name, value) for name, value in tensors.items()}
    layout = source_layout(src_fmt, specs)
    kind, config, out_config, _ = resolve(
        layout, specs, metadata, kind, num_heads, extra_config, "tensors"
    )
    return _convert(tensors, layout, dst_fmt, kind, config, out_config)


def metadata_for(kind: str, config: dict) -> dict[str, str]:
    return {META_KIND: kind, META_CONFIG: json.dumps(config, sort_keys=True)}


def convert_file(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    src_fmt: str,
    dst_fmt: str = "safetensors",
    *,
    kind: str | None = None,
    num_heads: int | None = None,
    prefix: str = "",
    extra_config: dict | None = None,
    trust_pickle: bool = False,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Conversion:
    """Convert weight file ``src`` to ``dst`` (written atomically; see `write_tensors`).

    Names, shapes and dtypes are checked against the module before any tensor data is
    read; at most ``max_bytes`` of tensor data are read. Raises PortError (nothing
    written) or `Interrupted`."""
    src, dst = Path(src), Path(dst)
    if dst_fmt not in FORMATS:
        raise PortError(f"unknown format {dst_fmt!r}; expected one of {', '.join(FORMATS)}.")
    with open_tensors(src, src_fmt, trust_pickle, max_bytes) as source:
        specs = source.specs
        if prefix:
            specs = {k[len(prefix) :]: v for k, v in specs.items() if k.startswith(prefix)}
            if not specs:
                raise PortError(f"{src}: no tensor name starts with {prefix!r}.")
        layout = source_layout(src_fmt, specs)
        kind, config, out_config, expected = resolve(
            layout, specs, source.metadata, kind, num_heads, extra_config, str(src)
        )
        _check_total({name: specs[name] for name in expected}, max_bytes, str(src))
        loaded = source.load([prefix + name for name in expected])
    arrays = {name[len(prefix) :]: arr for name, arr in loaded.items()}
    conv = _convert(arrays, layout, dst_fmt, kind, config, out_config)
    metadata = metadata_for(kind, out_config) if dst_fmt in METADATA_FORMATS else {}
    conv.removed_temp_files = write_tensors(dst, dst_fmt, conv.target_tensors, metadata)
    return conv


def save_portable(weights: PortableWeights, path: str | os.PathLike) -> None:
    """Write `PortableWeights` as a safetensors file (neutral names, config in metadata),
    atomically."""
    write_tensors(path, "safetensors", weights.weights, metadata_for(weights.kind, weights.config))


def load_portable(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> PortableWeights:
    """Read a file written by `save_portable` (or ``multiattn port ... --to safetensors``).

    Raises PortError when the metadata is missing or the tensors do not match it."""
    with open_tensors(path, "safetensors", max_bytes=max_bytes) as source:
        if META_KIND not in source.metadata:
            raise PortError(f"{path}: no {META_KIND!r} metadata; not a multiattn.port file.")
        kind, config, _, expected = resolve(
            "neutral", source.specs, source.metadata, where=str(path)
        )
        _check_total(source.specs, max_bytes, str(path))
        arrays = source.load(list(expected))
    return PortableWeights(kind, config, arrays)
