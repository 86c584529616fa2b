"""The row kernel (rowkernel.cpp): float32 products of a few rows that read each weight once, built for this CPU.

A step multiplies a few rows (a token, a draft of a few, a batch's rows) by every weight of the
model, so its price is reading the weights. torch's BLAS reads them at the memory's speed for
one row and slower from a few rows on, and oneDNN's packed weights cost more at one row; this
kernel reads them once for every row at about the one-row price, and gives each row the bits of
its one-row product (benchmarks/NOTES.md has the figures).

It is compiled on first use for AVX-512 or AVX2 with FMA (a C++ compiler and ninja, once per
machine: torch keeps the build under its extensions folder, named by the
instruction set and torch's version), together with the decoder's layer loop that calls it
(layerloop.py); elsewhere, where the build fails or where
LOOKAHEAD_ROW_KERNEL=off, `load` says why once and returns None, and the packed layers keep
oneDNN's products.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

MOST_ROWS = 64
"""Widest product run here: wider ones (a prompt's) go to the BLAS, which computes many rows faster."""
SWITCH = "LOOKAHEAD_ROW_KERNEL"
"""Set to 'off' (before the first engine starts) to keep oneDNN's products instead."""
_FLAGS = {"AVX512": ["-mavx512f", "-mavx512dq", "-mavx2", "-mfma"], "AVX2": ["-mavx2", "-mfma"]}
"""Compiler flags per instruction set torch reports for this CPU (torch.backends.cpu.get_cpu_capability)."""
_SOURCES = [Path(__file__).with_name(name) for name in ("rowkernel.cpp", "layerloop.cpp", "argmaxhead.cpp")]
"""The kernel, and what calls it — the decoder's layer loop (layerloop.py) and greedy choices (argmaxhead.py) — built
as one extension."""
STALE_LOCK_SECONDS = 600.0
"""A build lock this old was left by a build that was stopped (a build takes well under a minute): torch would wait
on it forever, so it is removed."""
_building = threading.Lock()
log = logging.getLogger("lookahead.rowkernel")


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernel for this CPU (built the first time), or None where it cannot be (logged once)."""
    if os.environ.get(SWITCH, "on").strip().lower() in ("off", "0", "false", "no"):
        log.info("%s is off: packed layers use oneDNN", SWITCH)
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    flags = next((_FLAGS[name] for name in _FLAGS if capability.startswith(name)), None)
    if flags is None:
        log.info("no row kernel for this CPU (torch reports %s; it needs AVX2 or AVX-512)", capability)
        return None
    _put_ninja_on_path()
    if shutil.which(os.environ.get("CXX", "c++")) is None or shutil.which("ninja") is None:
        log.warning("no C++ compiler or ninja here: the row kernel is not built, packed layers use oneDNN")
        return None
    from torch.utils import cpp_extension  # imported here: it is slow to import and only the build needs it

    torch_version = "".join(c if c.isalnum() else "_" for c in torch.__version__)  # another torch: another build
    name = f"lookahead_rowkernel_{capability.lower()}_torch{torch_version}"
    with _building:
        folder = getattr(cpp_extension, "_get_build_directory", None)  # torch's own, private: where a build locks
        if folder is not None:
            _clear_stale_lock(Path(folder(name, verbose=False)) / "lock")
        log.info("loading the row kernel for %s (built the first time: a few tens of seconds)", capability)
        try:
            return cpp_extension.load(
                name,
                [str(source) for source in _SOURCES],
                extra_cflags=["-O3", "-fopenmp", *flags],
                extra_ldflags=["-fopenmp"],
            )
        except (OSError, RuntimeError, ImportError) as err:  # a compiler error, a missing header, a broken cache
            log.warning("the row kernel could not be built (%s): packed layers use oneDNN", str(err).splitlines()[0])
            return None


@functools.cache
def fingerprint() -> str:
    """What names this kernel in cache keys: its sources and widest product, so passes timed on another are not used."""
    return hashlib.sha256(b"".join(source.read_bytes() for source in _SOURCES) + str(MOST_ROWS).encode()).hexdigest()[
        :8
    ]


def _clear_stale_lock(lock: Path) -> None:
    """Remove the build lock a stopped build left (torch's builder waits for it to go, without end)."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        log.warning("removing %s, left %.0f s ago by a row kernel build that was stopped", lock, age)
        lock.unlink(missing_ok=True)


def fits(x: torch.Tensor) -> bool:
    """Whether the kernel takes this input to a weight kept for it (float32 on the CPU: linears._packed_weight):
    float32, at most MOST_ROWS rows. Checked for every product of a pass, so no more than that."""
    return x.dtype is torch.float32 and x.numel() <= MOST_ROWS * x.shape[-1]


def _put_ninja_on_path() -> None:
    """The ninja that the `ninja` package installs lives beside this interpreter, which may not be on PATH."""
    try:
        import ninja
    except ImportError:
        return
    folder = getattr(ninja, "BIN_DIR", None)
    if folder and folder not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([folder, os.environ.get("PATH", "")])


if __name__ == "__main__":  # `make setup` builds it ahead, so that the first engine does not wait for it
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = load()
    print(f"row kernel: {'built, ' + built.__file__ if built is not None else 'not built (above); oneDNN is used'}")
