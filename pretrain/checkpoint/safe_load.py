"""Read `torch.save` files without running code from them.

`torch.load(weights_only=False)` unpickles whatever the file names: a checkpoint someone sent you
can import any module and call any function while it loads. Every checkpoint this project reads
(ours, DeepSpeed's, Megatron-LM's, Hugging Face `.bin`) goes through `load` instead, which uses
torch's restricted unpickler (`weights_only=True`: tensors, containers, numbers, strings, dtypes)
plus a short allowlist of the types these files really hold:

- RNG states (`rng_state_<rank>.pt`, Megatron's `rng_state`): numpy's `get_state()` tuple, i.e.
  numpy arrays of uint32 (`numpy.ndarray`, `numpy.dtype`, the uint32 dtype, numpy's array rebuild).
- DeepSpeed model/optimizer files (`deepspeed=True`): `ZeroStageEnum`, the fp16 loss scalers and
  `fragment_address`, plain data classes whose loading sets attributes and calls nothing else.
- Megatron-LM files (`megatron=True`): `argparse.Namespace` (the saved `args`), `io.BytesIO`
  (Transformer Engine's `_extra_state` in older versions), `signal.Signals` (`args.exit_signal`
  on Megatron-LM main: unpickling looks the member up by its number, nothing else) and Megatron's
  own enums in `args` (e.g. `AttnBackend.auto`). Those are *not* imported: each `megatron.*`
  global is replaced by an inert `ForeignValue` that records its name and arguments, so no
  Megatron code runs, and Megatron need not be installed.

Anything else (e.g. `os.system`, `builtins.eval`, a custom class) is refused with a one-line
`UserError` naming every such global in the file; the restricted unpickler stops at the first one,
before anything from the file is called.

torch.distributed.checkpoint folders (`.metadata`, the byte items in `.distcp` files) are read
by `pretrain/checkpoint/dcp_reader.py`, whose byte items come here (`load(..., data=)`).

Third-party readers (DeepSpeed's engine load, zero_to_fp32) call `torch.load(weights_only=False)`
themselves: they run inside `checked_torch_loads`, which routes each of their reads on the calling
thread through `load` (other threads' `torch.load` calls are torch's own meanwhile).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import pickletools
import re
import signal
import threading
import zipfile
from typing import Any

import numpy as np
import torch

from pretrain.errors import UserError

_NUMPY_RECONSTRUCT = (
    np._core.multiarray._reconstruct
    if hasattr(np, "_core")
    else np.core.multiarray._reconstruct  # numpy < 2
)
# numpy arrays as in np.random.get_state(): ("MT19937", uint32 array, pos, has_gauss, gauss)
NUMPY_RNG_TYPES = [_NUMPY_RECONSTRUCT, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
MEGATRON_TYPES = [argparse.Namespace, io.BytesIO, signal.Signals]
MEGATRON_PREFIX = "megatron."
_UNSUPPORTED = re.compile(r"GLOBAL ([\w.]+)")  # torch's message names the refused global
_TORCH_LOAD = torch.load  # torch's own: `checked_torch_loads` replaces torch.load while it runs
_CHECKED = threading.local()  # .depth: how many `checked_torch_loads` this thread is inside
_INSTALLED = threading.Lock()  # guards torch.load's replacement and `_inside`
_inside = 0  # `checked_torch_loads` open in this process, all threads together
_ALLOWLIST = threading.RLock()  # one `_only` at a time: each restores what the one before set


class ForeignValue:
    """Stands in for an object of a type this project does not import (e.g. a Megatron enum).

    Unpickling calls it with the arguments the original type would have received (an enum's
    value) and, for plain objects, sets their state: it stores both and does nothing else.
    """

    qualified_name = "?"

    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualified_name}{self.args!r}>"


def _stand_in(name: str) -> tuple[type, str]:
    """(an inert ForeignValue subclass, `name`): the form torch's safe_globals takes for renames."""
    return type(name.rsplit(".", 1)[-1], (ForeignValue,), {"qualified_name": name}), name


def _deepspeed_types() -> list:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def pickled_globals(path: str | bytes) -> list[str]:
    """Every `module.name` global that the pickle inside a torch.save zip file (or those bytes)
    refers to."""
    try:
        with zipfile.ZipFile(io.BytesIO(path) if isinstance(path, bytes) else path) as archive:
            pickle_name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
            data = archive.read(pickle_name)
    except (zipfile.BadZipFile, StopIteration, OSError):
        return []  # not the zip format: torch.load reports it
    names, strings = [], []
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name == "GLOBAL":
                names.append(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str):
                strings.append(arg)
    except ValueError:
        pass  # a truncated pickle: torch.load reports it
    return sorted(set(names))


def _allowed(megatron: bool, deepspeed: bool, path: str | bytes) -> list:
    allowed: list = list(NUMPY_RNG_TYPES)
    if deepspeed:
        allowed += _deepspeed_types()
    if megatron:
        allowed += MEGATRON_TYPES
        allowed += [_stand_in(n) for n in pickled_globals(path) if n.startswith(MEGATRON_PREFIX)]
    return allowed


def refused(path: str, names: list[str]) -> UserError:
    """The one-line refusal of `path` for the pickled globals `names`."""
    return UserError(
        f"{path}: refused to load: it holds pickled global(s) {', '.join(names)}, which a checkpoint "
        f"does not need and which could run code while loading (only tensors, plain containers "
        f"and a short allowlist of types are read; docs/CHECKPOINTS.md). Re-save it with plain "
        f"tensors, or do not use a file from a source you do not trust"
    )


@contextlib.contextmanager
def _only(allowed: list):
    """Exactly `allowed` on top of torch's own safe types while loading: libraries may widen
    torch's process-wide allowlist at import (megatron.core adds argparse.Namespace and more)."""
    with _ALLOWLIST:
        previous = torch.serialization.get_safe_globals()
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(allowed)
        try:
            yield
        finally:
            torch.serialization.clear_safe_globals()
            torch.serialization.add_safe_globals(previous)


def load(
    path: str,
    *,
    megatron: bool = False,
    deepspeed: bool = False,
    mmap: bool = False,
    data: bytes | None = None,
) -> Any:
    """`torch.load(path)` on CPU with the restricted unpickler and this module's allowlist
    (`mmap`: tensors memory-mapped from the file, read only when used). `data`: the torch.save
    bytes to read instead of the file (a byte range of a larger file, which `path` then names).

    UserError (one line) for a file that names a global outside the allowlist (all of them are
    listed) and for a damaged or unreadable file.
    """
    if data is None and not os.path.isfile(path):
        raise UserError(f"{path}: no such file (the checkpoint is incomplete)")
    source = path if data is None else data
    allowed = _allowed(megatron, deepspeed, source)
    permitted = _permitted(allowed)
    try:
        with _only(allowed):
            opened = path if data is None else io.BytesIO(data)
            return _TORCH_LOAD(opened, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # noqa: BLE001 - classified below, re-raised as one line
        message = str(err)
        first = refused_global(err)
        if first:
            foreign = [
                n
                for n in pickled_globals(source)
                if n not in permitted and not _torch_allows(n) and n != first
            ]
            raise refused(path, [first, *foreign]) from None
        raise UserError(
            f"{path}: cannot be read ({type(err).__name__}: {message.splitlines()[-1][:300]}); "
            f"the file is damaged or not a torch checkpoint"
        ) from None


def refused_global(err: BaseException) -> str | None:
    """The global that torch's restricted unpickler refused, as its error `err` names it."""
    found = _UNSUPPORTED.search(str(err))
    return found.group(1) if found else None


def _permitted(allowed: list) -> set[str]:
    """The `module.name` of each allowlisted type (or stand-in)."""
    permitted = {getattr(t, "__module__", "") + "." + getattr(t, "__name__", "") for t in allowed}
    return permitted | {t[1] for t in allowed if isinstance(t, tuple)}


def _torch_allows(name: str) -> bool:
    """Whether torch's restricted unpickler accepts `name` by itself (tensor rebuilds, dtypes...)."""
    if name.startswith("torch."):  # tensor rebuilds, storages, dtypes
        return True
    try:
        from torch._weights_only_unpickler import _get_allowed_globals
    except ImportError:  # a private helper: without it the error lists only the first refusal
        return True
    return name in _get_allowed_globals()


def _checked_torch_load(f, map_location=None, *args, **kwargs) -> Any:
    """torch.load's signature, `load`'s behaviour (allowlist, CPU; DeepSpeed's loads map to CPU
    and copy into the engine's tensors): what third-party code gets inside `checked_torch_loads`."""
    if not isinstance(f, str | os.PathLike):
        raise UserError(f"refused to load a checkpoint from {type(f).__name__} (not a file path)")
    path = os.fspath(f)
    # only the zip format maps; a legacy file is read whole, so its globals are named, not "damaged"
    return load(path, deepspeed=True, mmap=bool(kwargs.get("mmap")) and zipfile.is_zipfile(path))


def _torch_load_of_this_thread(f, *args, **kwargs) -> Any:
    """What `torch.load` is while any thread is inside `checked_torch_loads`: `load`'s behaviour
    on those threads, torch's own load unchanged on every other."""
    if getattr(_CHECKED, "depth", 0):
        return _checked_torch_load(f, *args, **kwargs)
    return _TORCH_LOAD(f, *args, **kwargs)


@contextlib.contextmanager
def checked_torch_loads():
    """While open, every `torch.load(path, ...)` this thread makes is `load(path, deepspeed=True)`;
    other threads (the background checkpoint writer) load as torch does.

    DeepSpeed's checkpoint loading unpickles with `torch.load(weights_only=False)` from several
    places (its checkpoint engine for model, optimizer and pipeline-layer files, zero_to_fp32 for
    ZeRO-3 weights, the universal-checkpoint readers). Around a call into it, this makes each of
    those reads the allowlisted one: the file that is checked is the file that is loaded, and a
    refused global is the one-line UserError of `load`.
    """
    global _inside
    with _INSTALLED:
        _inside += 1
        torch.load = _torch_load_of_this_thread
    _CHECKED.depth = getattr(_CHECKED, "depth", 0) + 1
    try:
        yield
    finally:
        _CHECKED.depth -= 1
        with _INSTALLED:
            _inside -= 1
            if not _inside:
                torch.load = _TORCH_LOAD


def refusal(path: str, *, megatron: bool = False, deepspeed: bool = False) -> str | None:
    """The one-line refusal `load` would raise for the globals the pickle in `path` names outside
    the allowlist, found by reading its opcodes (nothing is unpickled, no tensor is read), or None.

    For processes that must agree before a load (a refusal inside DeepSpeed's load on one rank
    would leave the others waiting in its collectives). Not the check that counts: a pickle can
    spell a global in ways this scan does not follow; `load` refuses those while unpickling.
    """
    permitted = _permitted(_allowed(megatron, deepspeed, path))
    names = pickled_globals(path) if zipfile.is_zipfile(path) else _legacy_globals(path)
    foreign = [n for n in names if n not in permitted and not _torch_allows(n)]
    return str(refused(path, sorted(set(foreign)))) if foreign else None


def _legacy_globals(path: str) -> list[str]:
    """The GLOBAL names in the leading pickles of torch's legacy (non-zip) format: magic number,
    protocol, system info, the object, the storage keys (the raw tensor bytes follow them)."""
    names: list[str] = []
    try:
        with open(path, "rb") as f:
            for _ in range(5):
                names += [
                    a.replace(" ", ".") for o, a, _ in pickletools.genops(f) if o.name == "GLOBAL"
                ]
    except (ValueError, OSError):
        pass  # not (or not all) pickles: torch.load reports it
    return names
