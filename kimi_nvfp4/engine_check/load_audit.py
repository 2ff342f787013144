"""Measure what an engine's weight loading wrote, without trusting the engine to say so (engine-agnostic).

- Sentinels: before loading, every floating parameter is filled with NaN and every integer one with
  all bits set. An element still holding its sentinel afterwards was never written. An integer
  element can legitimately equal any bit pattern (a packed E2M1 byte 0xFF is two -6 codes), so
  integer parameters with sentinel-valued elements are refilled with zero and the tensors routed to
  them are loaded again: an element never written holds the sentinel both times.
- Loader calls: every parameter's weight loader is wrapped to record which checkpoint tensor reached
  it. A loaded tensor is traced to the checkpoint tensor it is (or is a view of); a tensor the model's
  loader built itself (SGLang concatenates q_a_proj and kv_a_proj_with_mqa) is traced to the
  checkpoint tensors it concatenates. The wrapper also serialises the calls (the engine may submit
  them to a thread pool) so each call's writes can be told apart.
- Landing: for a floating parameter, the elements a call wrote (NaN turned into a value, or bits
  changed) must form a block that holds the loaded tensor bit for bit, plus zeros where the engine
  pads, or the loaded scalar in every element where the engine broadcasts one (SGLang writes an
  expert's input_scale into both halves of w13_input_scale).
On the meta device there are no values: only the loader calls are recorded.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

FLOAT_SENTINEL = float("nan")
INT_SENTINELS = (-1, 0)  # all bits set, then all clear
_MAX_FUSED_PARTS = 3  # tensors one fused load may concatenate (SGLang fuses two)


def is_float(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point


def nan_mask(t: torch.Tensor) -> torch.Tensor:
    # float8 has no isnan kernel on CPU: widen (NaN stays NaN)
    return torch.isnan(t.float() if t.element_size() == 1 else t)


def int_sentinel(dtype: torch.dtype, which: int) -> int:
    value = INT_SENTINELS[which]
    if value == -1 and not dtype.is_signed:
        return torch.iinfo(dtype).max
    return value


def fill_sentinels(params: dict[str, torch.nn.Parameter], which: int = 0, names: Iterable[str] | None = None) -> None:
    for name in names if names is not None else params:
        p = params[name]
        with torch.no_grad():
            p.data.fill_(FLOAT_SENTINEL if is_float(p) else int_sentinel(p.dtype, which))


def unwritten_mask(p: torch.Tensor, which: int = 0) -> torch.Tensor:
    return nan_mask(p.data) if is_float(p) else p.data == int_sentinel(p.dtype, which)


@dataclass
class LoaderCall:
    parameter: str
    sources: list[str]  # checkpoint tensors this call carried (empty: not traced)
    shape: tuple[int, ...]
    dtype: torch.dtype
    landed: bool | None = None  # None: not measurable (integer parameter, meta device)
    detail: str = ""
    built: torch.Tensor | None = None  # an untraced (model-built) tensor with values, kept to explain it


@dataclass
class _Yielded:
    name: str
    tensor: torch.Tensor


@dataclass
class LoadRecorder:
    """Wraps the weight loaders of `params` (a name -> Parameter map of the engine's model)."""

    params: dict[str, torch.nn.Parameter]
    measure_landing: bool
    calls: list[LoaderCall] = field(default_factory=list)
    _yielded: dict[int, _Yielded] = field(default_factory=dict)
    _by_name: dict[str, torch.Tensor] = field(default_factory=dict)
    _order: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _restore: list[Callable[[], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._param_names = {id(p): n for n, p in self.params.items()}

    # -- the tensors the engine reads
    def watch(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass the engine's (name, tensor) stream through, remembering each tensor (kept alive for tracing)."""
        for name, tensor in weights:
            self._yielded[id(tensor)] = _Yielded(name, tensor)
            self._by_name[name] = tensor
            self._order.append(name)
            yield name, tensor

    @property
    def read(self) -> list[str]:
        return list(self._order)

    def _trace(self, t: torch.Tensor) -> str | None:
        """The checkpoint tensor `t` is, or is a view of: by identity (also the meta device), else by memory range."""
        for candidate in (t, t._base):
            hit = self._yielded.get(id(candidate)) if candidate is not None else None
            if hit is not None and hit.tensor is candidate:
                return hit.name
        if t.device.type == "meta" or t.numel() == 0:
            return None
        ptr = t.data_ptr()
        for y in self._yielded.values():  # a view of a yielded view (whose _base is the file's buffer)
            start = y.tensor.data_ptr()
            if y.tensor.device == t.device and start <= ptr < start + y.tensor.numel() * y.tensor.element_size():
                return y.name
        return None

    # -- the loaders
    def install(self, default_loader: Callable[..., None]) -> None:
        """Wrap every parameter's weight loader; parameters without one get `default_loader` wrapped.

        SGLang's models fetch the loader with `getattr(param, "weight_loader", default_weight_loader)`,
        or `param.weight_loader`, which for its `BasevLLMParameter` is a read-only property over
        `_weight_loader`.
        """
        for param in self.params.values():
            if "_weight_loader" in param.__dict__:
                self._wrap(param, "_weight_loader", param.__dict__["_weight_loader"])
            elif "weight_loader" in param.__dict__:
                self._wrap(param, "weight_loader", param.__dict__["weight_loader"])
            else:
                self._wrap(param, "weight_loader", default_loader, added=True)

    def uninstall(self) -> None:
        for undo in reversed(self._restore):
            undo()
        self._restore.clear()

    def _wrap(self, param: torch.nn.Parameter, attr: str, original: Callable[..., None], added: bool = False) -> None:
        recorder = self

        def recorded(target: torch.nn.Parameter, loaded: torch.Tensor, *args: object, **kwargs: object) -> object:
            return recorder._call(original, target, loaded, args, kwargs)

        setattr(param, attr, recorded)
        if added:
            self._restore.append(lambda: delattr(param, attr))
        else:
            self._restore.append(lambda: setattr(param, attr, original))

    def _call(self, original, target, loaded, args, kwargs):
        name = self._param_names.get(id(target), "?")
        with self._lock:
            before = target.data.detach().clone() if self.measure_landing and is_float(target) else None
            result = original(target, loaded, *args, **kwargs)
            source = self._trace(loaded)
            call = LoaderCall(name, [source] if source else [], tuple(loaded.shape), loaded.dtype)
            if source is None and loaded.device.type != "meta":
                call.built = loaded.detach().clone()
            if before is not None:
                call.landed, call.detail = _landing(before, target.data, loaded)
            self.calls.append(call)
        return result

    # -- after loading
    def attribute_fused(self) -> tuple[dict[str, list[str]], list[str]]:
        """Trace loads of tensors the model built itself to the checkpoint tensors they concatenate.

        Returns (parameter -> its checkpoint tensors in concatenation order, parameters loaded from a tensor
        that no concatenation of unrouted checkpoint tensors explains). With values, the concatenation must
        equal the built tensor bit for bit; on the meta device only the shapes can agree.
        """
        routed = {s for c in self.calls for s in c.sources}
        pending = [n for n in self._order if n not in routed]
        fused: dict[str, list[str]] = {}
        unexplained: list[str] = []
        for call in self.calls:
            if call.sources:
                continue
            parts = _concatenated_parts(call, pending, self._tensor_by_name)
            if parts:
                call.sources = parts
                fused[call.parameter] = parts
                pending = [n for n in pending if n not in parts]
            else:
                unexplained.append(call.parameter)
            call.built = None
        return fused, unexplained

    def _tensor_by_name(self, name: str) -> torch.Tensor:
        return self._by_name[name]

    def routed(self) -> set[str]:
        return {s for c in self.calls for s in c.sources}

    def names_routed_to(self, parameters: set[str]) -> set[str]:
        return {s for c in self.calls if c.parameter in parameters for s in c.sources}

    def called_parameters(self) -> set[str]:
        return {c.parameter for c in self.calls}

    def release(self) -> None:
        """Drop the references to the read tensors (memory)."""
        self._yielded.clear()
        self._by_name.clear()


def _parent(name: str) -> str:
    module = name.rsplit(".", 1)[0]  # drop the parameter leaf ("weight")
    return module.rsplit(".", 1)[0]  # drop the (fused) module's own name


def _concatenated_parts(call: LoaderCall, pending: list[str], tensor: Callable[[str], torch.Tensor]) -> list[str]:
    """The pending checkpoint tensors of the same parent module whose concatenation (dim 0) is this load."""
    leaf = call.parameter.rsplit(".", 1)[-1]
    parent = _parent(call.parameter)
    candidates = [n for n in pending if n.rsplit(".", 1)[-1] == leaf and _parent(n) == parent]
    for k in range(2, _MAX_FUSED_PARTS + 1):
        for combo in itertools.permutations(candidates, k):
            ts = [tensor(n) for n in combo]
            if any(t.dtype != call.dtype or t.shape[1:] != call.shape[1:] for t in ts):
                continue
            if sum(t.shape[0] for t in ts) != call.shape[0]:
                continue
            if call.built is None or _bits_equal(torch.cat([t.to(call.built.device) for t in ts]), call.built):
                return list(combo)
    return []


def _landing(before: torch.Tensor, after: torch.Tensor, loaded: torch.Tensor) -> tuple[bool | None, str]:
    """Did `loaded` land bit for bit in the block of elements this call wrote (zero padding, scalar broadcast allowed)?"""
    written = (nan_mask(before) & ~nan_mask(after)) | _bits_differ(before, after)
    if not bool(written.any()):
        return None, "rewrote elements that already held these values"
    idx = written.nonzero()
    lo, hi = idx.min(dim=0).values.tolist(), (idx.max(dim=0).values + 1).tolist()
    box = tuple(slice(a, b) for a, b in zip(lo, hi))
    if not bool(written[box].all()):
        return False, "the elements written do not form one block"
    block = after[box]
    while block.ndim > loaded.ndim and block.shape[0] == 1:
        block = block[0]
    src = loaded.detach().to(device=block.device, dtype=block.dtype)
    if src.ndim == 0 and block.numel() > 1:
        same = _bits_equal(block, src.expand(block.shape))
        return (True, f"broadcast into {list(block.shape)}") if same else (False, "broadcast block differs")
    if block.ndim != src.ndim or any(b < s for b, s in zip(block.shape, src.shape)):
        return False, f"wrote a {list(block.shape)} block for a {list(src.shape)} tensor"
    head = block[tuple(slice(0, s) for s in src.shape)]
    if not _bits_equal(head, src):
        return False, "the written block differs from the checkpoint tensor"
    pad = block.clone()
    pad[tuple(slice(0, s) for s in src.shape)] = 0
    if bool((pad.float() != 0).any()):
        return False, "padding around the tensor is not zero"
    return True, "" if block.shape == src.shape else f"zero-padded to {list(block.shape)}"


def _bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.contiguous().view(width) != b.contiguous().view(width)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_bytes = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731 - bits, so -0.0 != 0.0
    return torch.equal(as_bytes(a), as_bytes(b))
