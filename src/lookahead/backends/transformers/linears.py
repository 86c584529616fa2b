"""The model's linear layers through oneDNN with their weights packed once, for the engine's passes on a CPU.

torch's float32 `linear` on a CPU calls the BLAS for every product with the weight in its
stored layout, and for a handful of rows the BLAS may take a small-matrix path that reads the
weights slowly (on some CPUs 2-3 rows cost more than 8). oneDNN reads a weight reordered once
into its own blocked layout (what torch's compiler does with frozen weights) at nearly the same
price for 1 to 8 rows, so a draft of a few tokens costs little more than one token. Which is
faster for how many rows depends on the CPU: kernels.py measures it.

bfloat16 weights are packed too where oneDNN computes bfloat16 on this CPU (AVX-512 with BF16,
or AMX; its own check): torch's bfloat16 `linear` reaches oneDNN as well, but with the weight in
the model's layout every call.

The model stays as it is: the packed copies live here (they double the memory of the linear
weights; every engine on a model shares one copy), and each layer is routed to them only within
the engine's passes (`packed_as`). A weight changed in place or replaced after packing is packed
again before its next pass; one moved to another dtype or device computes as the model's layer.

As with the model's own layers, a token's logits in a draft block may differ in the last bits
from its one-token pass (oneDNN takes another path for a single row of some shapes, and
attention sums a block otherwise): in float32, exactness is of tokens, held against `generate()`
by the tests, as on every backend. In bfloat16 a product of up to some number of rows may give
each row the bits of its one-row product, and a wider one not; `packed_as` then makes wider
products in pieces that do (capability.settle_rounding finds the number).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class PackedLinear:
    """One linear layer's weight in oneDNN's layout, with what it was packed from."""

    weight: torch.Tensor
    version: int
    """The weight's version counter when packed (an in-place change, e.g. `load_state_dict`, raises it)."""
    address: int
    """Where its data was (`module.to()` or `weight.data = ...` move it without a new version)."""
    packed: torch.Tensor

    def __call__(self, module: torch.nn.Linear, x: torch.Tensor, most_rows: int | None = None) -> torch.Tensor:
        """`module(x)` from the packed weight; with `most_rows`, in products of at most that many rows."""
        weight = module.weight
        if weight is not self.weight or weight._version != self.version or weight.data_ptr() != self.address:
            if not _packable_weight(weight):  # moved to another dtype or device since: the layer computes itself
                return torch.nn.functional.linear(x, weight, module.bias)
            self.__dict__.update(vars(pack(module)))  # changed since: packed again, before it is used
        if most_rows is None or x.numel() <= most_rows * x.shape[-1]:
            return self._product(module, x)
        pieces = [self._product(module, piece) for piece in x.reshape(-1, x.shape[-1]).split(most_rows)]
        return torch.cat(pieces).reshape(*x.shape[:-1], -1)

    def _product(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, module.bias, "none", [], "")


class PackedLinears:
    """Packed copies of a model's plain `torch.nn.Linear` layers on the CPU (float32, or bfloat16 where supported)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers: dict[torch.nn.Linear, PackedLinear] = {
            module: pack(module) for module in model.modules() if packable(module)
        }
        self._forwards: dict[int | None, dict[torch.nn.Linear, functools.partial]] = {}
        self.verdicts: dict[str, int | None] = {}
        """From how many tokens a pass measured faster packed, by what the measurement depends on
        (kernels.packed_from; None: never)."""

    def __len__(self) -> int:
        return len(self.layers)

    def forwards(self, most_rows: int | None = None) -> dict[torch.nn.Linear, functools.partial]:
        """What each layer's `forward` is within a pass whose products take at most `most_rows` rows (None: any);
        made once for each number, not every pass."""
        if most_rows not in self._forwards:
            self._forwards[most_rows] = {
                module: functools.partial(layer, module, most_rows=most_rows) for module, layer in self.layers.items()
            }
        return self._forwards[most_rows]


_shared: weakref.WeakKeyDictionary[torch.nn.Module, PackedLinears] = weakref.WeakKeyDictionary()
_sharing = threading.Lock()


def packed_linears(model: torch.nn.Module) -> PackedLinears:
    """The model's packed layers, one copy for every engine on it (each copy is as large as the weights)."""
    with _sharing:
        linears = _shared.get(model)
        if linears is None or list(linears.layers) != [module for module in model.modules() if packable(module)]:
            linears = _shared[model] = PackedLinears(model)  # first, or the model's layers changed since
        return linears


def available() -> bool:
    """Whether this torch has oneDNN and its packed linear operators."""
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
    )


def packable(module: torch.nn.Module) -> bool:
    """A plain Linear (not a subclass: quantized and adapter layers compute otherwise) of CPU weights in a packable
    dtype, whose `forward` is its class's (a library that replaced it, e.g. to offload weights, keeps it)."""
    own = vars(module).get("forward")
    routed = own is None or (isinstance(own, functools.partial) and isinstance(own.func, PackedLinear))  # ours
    return type(module) is torch.nn.Linear and _packable_weight(module.weight) and routed


def _packable_weight(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in packable_dtypes()


@functools.cache
def packable_dtypes() -> frozenset[torch.dtype]:
    """float32, and bfloat16 where oneDNN says this CPU computes it (else torch would emulate it slowly)."""
    bfloat16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return frozenset({torch.float32, *([torch.bfloat16] if bfloat16 is not None and bfloat16() else [])})


def pack(module: torch.nn.Linear) -> PackedLinear:
    weight = module.weight
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        return PackedLinear(weight, weight._version, weight.data_ptr(), packed)


@contextlib.contextmanager
def packed_as(linears: PackedLinears | None, most_rows: int | None = None) -> Iterator[None]:
    """Within: each packed layer computes with its packed weight, in products of at most `most_rows` rows (None:
    whole); `linears` None changes nothing."""
    if linears is None:
        yield
        return
    for module, forward in linears.forwards(most_rows).items():
        module.forward = forward
    try:
        yield
    finally:
        for module in linears.layers:
            vars(module).pop("forward", None)
