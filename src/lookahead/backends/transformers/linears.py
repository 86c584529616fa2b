"""The model's linear layers through faster kernels than the BLAS's for the engine's passes on a CPU.

torch's float32 `linear` on a CPU calls the BLAS for every product with the weight in its
stored layout, and for a handful of rows the BLAS may take a small-matrix path that reads the
weights slowly (on some CPUs 2-3 rows cost more than 8). Two kernels read them at nearly the
same price for 1 to 8 rows, so a draft of a few tokens costs little more than one token: in
float32 the row kernel (rowkernel.py, built for this CPU), which reads the weights as they are;
where it is not built, and in bfloat16, oneDNN, which reads a weight reordered once into its own
blocked layout (what torch's compiler does with frozen weights). Which is faster than the
model's own layers for how many rows depends on the CPU: kernels.py measures it.

bfloat16 weights are packed too where oneDNN computes bfloat16 on this CPU (AVX-512 with BF16,
or AMX; its own check): torch's bfloat16 `linear` reaches oneDNN as well, but with the weight in
the model's layout every call.

The model stays as it is: the packed copies live here (oneDNN's double the memory of the linear
weights, the row kernel's are the weights themselves; every engine on a model shares one set), and
each layer is routed to them only within the engine's passes (`packed_as`). A weight changed in
place or replaced after packing is packed again before its next pass; one moved to another dtype
or device computes as the model's layer.

As with the model's own layers, a token's logits in a draft block may differ in the last bits
from its one-token pass (oneDNN takes another path for a single row of some shapes, though the
row kernel does not, and attention sums a block otherwise): in float32, exactness is of tokens,
held against `generate()` by the tests, as on every backend. In bfloat16 a product of up to some
number of rows may give each row the bits of its one-row product, and a wider one not;
`packed_as` then makes wider products in pieces that do (capability.settle_rounding finds the
number).

Layers that read the same input (a layer's q/k/v projections, its MLP's gate and up) can be
joined into one packed product (`PackedLinears.joined`, which the direct decoder calls) where
that gives each layer's own bits; the joined copies cost those weights' memory once more.
`LookaheadConfig(linears="model")` keeps the model's own layers and packs nothing.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from . import rowkernel

JOIN_ROWS = 64
"""Most rows a joined product takes (a wider one, a prompt's, is made layer by layer): every width up to it is checked
to give the layers' own bits."""


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
        packed = self.current(module)
        if packed is None:
            return torch.nn.functional.linear(x, module.weight, module.bias)
        return _product(x, packed, module.bias, most_rows)

    def current(self, module: torch.nn.Linear) -> torch.Tensor | None:
        """The packed weight of `module`'s weight as it is now (packed again first if it changed); None where the
        layer computes itself (its weight moved to another dtype or device since)."""
        weight = module.weight
        if weight is not self.weight or weight._version != self.version or weight.data_ptr() != self.address:
            if not _packable_weight(weight):
                return None
            self.__dict__.update(vars(pack(module, not self.packed.is_mkldnn)))
        return self.packed


@dataclass
class JoinedLinear:
    """Linear layers that read the same input (a layer's q/k/v projections, its MLP's gate and up) packed as one
    weight: one product instead of several, split after. On a CPU each product has a price of its own besides the
    weight it reads, and small weights are read slower than large ones."""

    tensors: tuple[torch.Tensor | None, ...]
    """Each layer's weight and bias when packed (kept, so that their identities stay theirs)."""
    stamps: tuple[tuple[int, int, int] | None, ...]
    threads: int
    """Threads when packed: the kernel, and so the bits, may depend on them."""
    packed: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, modules: tuple[torch.nn.Linear, ...], rows: bool = False) -> JoinedLinear:
        """The layers' weights (and biases, where every layer has one) packed as one (`rows`: for the row kernel)."""
        tensors = tuple(tensor for module in modules for tensor in (module.weight, module.bias))
        with torch.no_grad():
            packed = _packed_weight(torch.cat([m.weight.detach() for m in modules]), rows)
            biased = modules[0].bias is not None
            bias = torch.cat([module.bias.detach() for module in modules]) if biased else None
        sizes = tuple(module.weight.shape[0] for module in modules)
        return cls(tensors, tuple(map(stamp, tensors)), torch.get_num_threads(), packed, bias, sizes)

    def current(self, modules: tuple[torch.nn.Linear, ...]) -> bool:
        """Whether every layer still has the weight and bias this was packed from, unchanged, on as many threads."""
        stamps = tuple(stamp(tensor) for module in modules for tensor in (module.weight, module.bias))
        return stamps == self.stamps and torch.get_num_threads() == self.threads

    def __call__(self, x: torch.Tensor, most_rows: int | None) -> tuple[torch.Tensor, ...]:
        """Each layer's output for `x` (products of at most `most_rows` rows; None: any)."""
        return _product(x, self.packed, self.bias, most_rows).split(self.sizes, dim=-1)

    def same_bits(self, modules: tuple[torch.nn.Linear, ...], layers: Sequence[PackedLinear]) -> bool:
        """Whether each part equals its layer's own packed product in every bit, for every width up to JOIN_ROWS
        rows (oneDNN picks its kernel by shape, so random inputs of each width answer for all inputs)."""
        generator = torch.Generator().manual_seed(0)
        features = modules[0].weight.shape[1]
        with torch.inference_mode():
            for rows in range(1, JOIN_ROWS + 1):
                x = torch.randn(rows, features, generator=generator).to(modules[0].weight.dtype)
                own = [layer(module, x) for module, layer in zip(modules, layers, strict=True)]
                if not all(map(torch.equal, self(x, None), own)):
                    return False
        return True


def stamp(tensor: torch.Tensor | None) -> tuple[int, int, int] | None:
    """What tells a tensor is the one it was, unchanged: identity, version counter (in-place changes) and address."""
    return None if tensor is None else (id(tensor), tensor._version, tensor.data_ptr())


def _product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, most_rows: int | None) -> torch.Tensor:
    """`x` times a packed weight (plus `bias`); with `most_rows`, in products of at most that many rows.

    A weight kept in its own layout (not oneDNN's) is the row kernel's, which gives every row its one-row bits
    whatever the product's width (so `most_rows` changes nothing there); a product too wide for it is the BLAS's."""
    if not packed.is_mkldnn:
        kernel = rowkernel.load()
        if kernel is not None and rowkernel.fits(x):
            return kernel.linear(x, packed, bias)
        return torch.nn.functional.linear(x, packed, bias)
    if most_rows is None or x.numel() <= most_rows * x.shape[-1]:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    rows = x.reshape(-1, x.shape[-1]).split(most_rows)
    pieces = [torch.ops.mkldnn._linear_pointwise(piece, packed, bias, "none", [], "") for piece in rows]
    return torch.cat(pieces).reshape(*x.shape[:-1], -1)


class PackedLinears:
    """Packed copies of a model's plain `torch.nn.Linear` layers on the CPU (float32, or bfloat16 where supported)."""

    def __init__(self, model: torch.nn.Module) -> None:
        layers = [module for module in model.modules() if packable(module)]
        self.rows = any(module.weight.dtype == torch.float32 for module in layers) and rowkernel.load() is not None
        """float32 layers run the row kernel (built for this CPU), else oneDNN's products."""
        self.layers: dict[torch.nn.Linear, PackedLinear] = {module: pack(module, self.rows) for module in layers}
        self._forwards: dict[int | None, dict[torch.nn.Linear, functools.partial]] = {}
        self._joined: dict[tuple[torch.nn.Linear, ...], JoinedLinear | None] = {}
        """Joined products made so far (None: those layers are not joined)."""
        self._same_bits: dict[tuple[object, ...], bool] = {}
        """Whether joined products of a shape give their layers' bits (JoinedLinear.same_bits), by dtype, input
        width, bias, output sizes and threads."""
        self.verdicts: dict[str, int | None] = {}
        """From how many tokens a pass measured faster packed, by what the measurement depends on
        (kernels.packed_from; None: never)."""

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def kind(self) -> str:
        """Which kernel the float32 layers run, as cache keys name it: 'rows-' and the row kernel's fingerprint, or
        'packed' (oneDNN)."""
        return f"rows-{rowkernel.fingerprint()}" if self.rows else "packed"

    def forwards(self, most_rows: int | None = None) -> dict[torch.nn.Linear, functools.partial]:
        """What each layer's `forward` is within a pass whose products take at most `most_rows` rows (None: any);
        made once for each number, not every pass."""
        if most_rows not in self._forwards:
            self._forwards[most_rows] = {
                module: functools.partial(layer, module, most_rows=most_rows) for module, layer in self.layers.items()
            }
        return self._forwards[most_rows]

    def joined(
        self, modules: tuple[torch.nn.Linear, ...], x: torch.Tensor, most_rows: int | None = None
    ) -> tuple[torch.Tensor, ...] | None:
        """Each layer's output for `x` from one product of their weights packed as one, with the bits of their own
        products; None where they are not joined (a product of more than JOIN_ROWS rows, a layer not packed here,
        biases on some, a shape whose joined product rounds otherwise: decided at the first call). A joined product
        is made again after a weight, a bias or the thread count changed. The layers' hooks do not run: join only
        layers without."""
        rows = x.numel() // x.shape[-1]
        if min(rows, most_rows or rows) > JOIN_ROWS:
            return None
        joined = self._current_join(modules)
        return None if joined is None else joined(x, most_rows)

    def row_weights(self, modules: tuple[torch.nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The weight and bias the row kernel multiplies by for `modules`' products of up to JOIN_ROWS rows (one
        layer's, or several joined as `joined` joins them), as they are now; None where those are not its products."""
        if len(modules) == 1:
            layer = self.layers.get(modules[0])
            packed = None if layer is None else layer.current(modules[0])
            return None if packed is None or packed.is_mkldnn else (packed, modules[0].bias)
        joined = self._current_join(modules)
        return None if joined is None or joined.packed.is_mkldnn else (joined.packed, joined.bias)

    def _current_join(self, modules: tuple[torch.nn.Linear, ...]) -> JoinedLinear | None:
        """The layers' joined product as their weights are now (made again after a change), or None."""
        joined = self._joined.get(modules)
        if modules not in self._joined or (joined is not None and not joined.current(modules)):
            joined = self._joined[modules] = self._join(modules)
        return joined

    def _join(self, modules: tuple[torch.nn.Linear, ...]) -> JoinedLinear | None:
        """The layers joined, where they are packed here alike and a joined product of their shape keeps the bits."""
        if not all(module in self.layers and _packable_weight(module.weight) for module in modules):
            return None
        kinds = {(module.weight.dtype, module.weight.shape[1], module.bias is not None) for module in modules}
        if len(kinds) != 1:
            return None
        shape = (*kinds, tuple(module.weight.shape[0] for module in modules), torch.get_num_threads())
        if self._same_bits.get(shape) is False:
            return None  # known to round otherwise: not packed for nothing
        joined = JoinedLinear.of(modules, self.rows)
        if shape not in self._same_bits:
            self._same_bits[shape] = joined.same_bits(modules, [self.layers[module] for module in modules])
        return joined if self._same_bits[shape] else None


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


def pack(module: torch.nn.Linear, rows: bool = False) -> PackedLinear:
    """The layer's weight packed for oneDNN, or with `rows` (and float32) kept for the row kernel."""
    weight = module.weight
    with torch.no_grad():
        return PackedLinear(weight, weight._version, weight.data_ptr(), _packed_weight(weight.detach(), rows))


def _packed_weight(weight: torch.Tensor, rows: bool) -> torch.Tensor:
    """A float32 weight as the row kernel reads it (contiguous: itself where it is), else reordered for oneDNN."""
    if rows and weight.dtype == torch.float32:
        return weight.contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


@contextlib.contextmanager
def packed_as(linears: PackedLinears | None, most_rows: int | None = None) -> Iterator[None]:
    """Within: each packed layer computes with its packed weight, in products of at most `most_rows` rows (None:
    whole); `linears` None changes nothing."""
    if linears is None:
        yield
        return
    for module, forward in linears.forwards(most_rows).items():
        vars(module)["forward"] = forward  # past nn.Module.__setattr__, which has nothing to do for it
    try:
        yield
    finally:
        for module in linears.layers:
            vars(module).pop("forward", None)
