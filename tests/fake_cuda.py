"""A CUDA device imitated on a CPU-only torch, for tests of the code paths a GPU takes.

CI has no GPU; two kinds of mistake show only on one: a host tensor meeting a device tensor
in one operation ("Expected all tensors to be on the same device"), and a place where the
host waits for the GPU's queued work (a copy to the host, a Python number read from a
device tensor, a blocking copy to the device), which leaves the GPU idle while the host
queues the next kernels — the difference between a measurement at the forward pass's speed
and one well over it.

Inside ``FakeCuda()`` a tensor is "on cuda:0" when it was made there (``device="cuda"``,
``.to("cuda")``, ``.cuda()``), derived from one that was, or marked by ``on_fake_cuda``;
the rest are on the host. An operation mixing a device tensor with a host tensor of one or
more dimensions raises as CUDA does. Every point where a real GPU would make the host wait
is recorded in ``waits`` as ``(what, where)``: ``where`` is the innermost frame of this
package (else lm-eval's, else transformers'). ``pin_memory`` must be patched to return a
copy (``pinned``); a non-blocking copy from such a copy is the one copy to the device that
does not wait, as on CUDA.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

DEVICE = torch.device("cuda", 0)
_ON_DEVICE = WeakIdKeyDictionary()
_PINNED = WeakIdKeyDictionary()
# Reading these of a device tensor gives the host a value: it waits for the GPU.
_READS = {"cpu", "item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__",
          "nonzero", "masked_select", "unique", "unique_consecutive", "equal", "allclose"}
# Operations that take a host source into a device tensor (a copy to the device).
_COPIES_IN = {"copy_", "__setitem__", "index_put_", "index_put"}
_FRAMES = ("lm_eval_headloc/", "lm_eval/", "transformers/")


def on_device(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor in _ON_DEVICE


def _mark(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        _ON_DEVICE[value] = True
    elif isinstance(value, (list, tuple)):
        for item in value:
            _mark(item)
    elif isinstance(value, dict):
        for item in value.values():
            _mark(item)
    return value


def _tensors(value: Any, found: list[torch.Tensor], depth: int = 0) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, found, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for item in value.values():
            _tensors(item, found, depth + 1)
    return found


def _is_device(device: Any) -> bool | None:
    """True for the imitated GPU, False for the host, None when ``device`` names none."""
    if device is None or isinstance(device, (torch.dtype, bool)):
        return None
    if isinstance(device, torch.Tensor):
        return on_device(device)
    if isinstance(device, int):
        return True
    return torch.device(device).type == "cuda"


def _where() -> str:
    stack = traceback.extract_stack()[:-3]
    for fragment in _FRAMES:
        frames = [f for f in stack if fragment in f.filename.replace("\\", "/")]
        if frames:
            frame = frames[-1]
            name = frame.filename.replace("\\", "/").split(fragment.split("/")[0] + "/")[-1]
            return f"{fragment.split('/')[0]}/{name}:{frame.lineno}"
    return f"{stack[-1].filename}:{stack[-1].lineno}"


def pinned(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``Tensor.pin_memory`` for a CPU-only torch (which refuses to pin): a marked copy."""
    copy = tensor.clone()
    _PINNED[copy] = True
    return copy


def on_fake_cuda(lm: Any) -> Any:
    """Put ``lm`` (hf-headablate) on the imitated GPU: its weights, buffers, ``device`` and
    the knockout's per-layer devices."""
    for tensor in (*lm.model.parameters(), *lm.model.buffers()):
        _mark(tensor)
    lm._device = DEVICE
    for site in lm.knockout._sites.values():
        site.devices = [None if d is None else DEVICE for d in site.devices]
    return lm


class FakeCuda(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.waits: list[tuple[str, str]] = []

    def _wait(self, what: str) -> None:
        self.waits.append((what, _where()))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", str(func))
        owner = getattr(func, "__self__", None)
        first = args[0] if args else None
        if name == "__get__" and owner is not None:  # tensor properties
            prop = getattr(owner, "__name__", "")
            if prop == "device":
                return DEVICE if on_device(first) else torch.device("cpu")
            if prop == "is_cuda":
                return on_device(first)
            if prop == "is_cpu":
                return not on_device(first)
        if isinstance(first, torch.Tensor) and on_device(first):
            if name in ("numpy", "__array__"):
                raise TypeError("can't convert cuda:0 device type tensor to numpy")
            if name in _READS:
                self._wait(f"to the host: {name}")
            if name == "cpu":
                return first.clone()
            if name == "cuda":
                return first
        if name == "cuda" and isinstance(first, torch.Tensor):
            return self._to_device(first, first.clone(), non_blocking=kwargs.get(
                "non_blocking", False))
        if name == "to" and isinstance(first, torch.Tensor):
            return self._to(first, list(args[1:]), kwargs)
        target = None
        if "device" in kwargs:
            target = _is_device(kwargs["device"])
            if target:
                kwargs["device"] = "cpu"
                if name in ("tensor", "as_tensor") and args and \
                        torch.as_tensor(args[0]).numel() > 0:
                    self._wait(f"to the device: torch.{name} from host data")
        inputs = _tensors(args, []) + _tensors(kwargs, [])
        any_on_device = any(on_device(t) for t in inputs)
        if any_on_device:
            host = [t for t in inputs if not on_device(t) and t.dim() > 0]
            if name in _COPIES_IN and on_device(first) and host:
                source = host[-1]
                if not (source in _PINNED and kwargs.get("non_blocking")):
                    self._wait(f"to the device: {name} from the host")
            elif name == "__getitem__":
                if not on_device(first):
                    raise RuntimeError(f"indices on cuda:0 index a host tensor ({_where()})")
            elif host and name not in ("is_same_size", "_has_compatible_shallow_copy_type",
                                       "set_", "__set__"):
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but found at least two "
                    f"devices, cuda:0 and cpu! ({name} at {_where()})")
        out = func(*args, **kwargs)
        if target or (target is None and any_on_device
                      and name not in ("tolist", "item", "cpu", "numpy")):
            _mark(out)
        return out

    def _to(self, tensor: torch.Tensor, rest: list[Any], kwargs: dict[str, Any]) -> Any:
        device = kwargs.pop("device", None)
        if rest and isinstance(rest[0], torch.Tensor):  # .to(other): its device and dtype
            other = rest.pop(0)
            device, kwargs["dtype"] = (DEVICE if on_device(other) else "cpu"), other.dtype
        elif rest and _is_device(rest[0]) is not None:
            device = rest.pop(0)
        non_blocking = kwargs.pop("non_blocking", False)
        converted = tensor.to(*rest, **kwargs) if rest or kwargs else tensor
        target = _is_device(device)
        if target is None or target == on_device(tensor):
            if converted is not tensor and on_device(tensor):
                _mark(converted)
            return converted
        copy = converted.clone() if converted is tensor else converted
        if target:
            return self._to_device(tensor, copy, non_blocking)
        self._wait("to the host: to")
        return copy

    def _to_device(self, source: torch.Tensor, copy: torch.Tensor,
                   non_blocking: bool) -> torch.Tensor:
        if not (source in _PINNED and non_blocking) and source.numel() > 0:
            self._wait("to the device: a blocking copy")
        return _mark(copy)
