"""Recording an unmodified torch module's own ``load_weights`` (``ferry.record_load``).

The module's parameters are swapped for :class:`RecordingTensor` s: real ``torch.Tensor``
subclasses (over a ``meta`` tensor of the same shape, strides and dtype, so no bytes)
whose every torch call goes through ``__torch_function__``. View ops, metadata and
writes (``copy_``, ``zero_``, ``fill_(0)``, ``p[idx] = w``) are forwarded to ferry's own
recording tensors (``ferry.Tensor``, over the C++ recorder), so the plan is recorded by
the same code as ``ferry.record()``; anything else needs values and raises
``ferry.RecordingError`` naming the op and the tensor.
"""
import operator

from . import _tensor
from ._plan import Plan, TensorDecl, record
from .errors import InvalidArgumentError, RecordingError

_torch_class = None

# Names forwarded to ferry.Tensor (views, metadata, recorded writes). Properties arrive
# as "<name>" from their descriptor's __get__.
_FORWARDED = set(_tensor._TORCH_VIEW_FUNCTIONS) | {
    "data", "shape", "dtype", "device", "ndim", "T", "is_cuda", "requires_grad", "nbytes", "ndimension",
    "nelement", "element_size", "storage_offset", "swapaxes", "swapdims", "__len__", "__iter__", "unflatten",
}


def _func_name(func):
    name = getattr(func, "__name__", None) or str(func)
    if name in ("__get__", "__set__", "__delete__"):
        owner = getattr(func, "__self__", None)
        prop = getattr(owner, "__name__", "?")
        return prop if name == "__get__" else f"{prop} ({name[2:-2]})"
    return name


def _recording_class():
    """torch is imported only when record_load is used; the class is made once."""
    global _torch_class
    if _torch_class is not None:
        return _torch_class
    import torch

    def unwrap(a):
        if isinstance(a, RecordingTensor):
            return a._ferry
        if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
            return type(a)(unwrap(x) for x in a) if not hasattr(a, "_fields") else a
        return a

    def wrap(r):
        if isinstance(r, _tensor.Tensor):
            return RecordingTensor._wrap(r)
        if isinstance(r, tuple) and not isinstance(r, torch.Size):
            return tuple(wrap(x) for x in r)
        if hasattr(r, "__next__"):  # __iter__
            return (wrap(x) for x in r)
        return r

    def first_recording(args, kwargs):
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, RecordingTensor):
                return a
            if isinstance(a, (list, tuple)):
                for x in a:
                    if isinstance(x, RecordingTensor):
                        return x
        return None

    _meta_bases = {}

    class RecordingTensor(torch.Tensor):
        """A recording tensor that is a ``torch.Tensor`` (device ``meta``): what
        ``ferry.record_load`` hands a module's ``load_weights``, as its parameters and as
        the checkpoint tensors. ``.ferry`` is the underlying :class:`ferry.Tensor`."""

        @staticmethod
        def _wrap(ft):
            h = ft._t
            name = _tensor._TORCH_NAMES[h.dtype]
            dtype = getattr(torch, name, None)
            if dtype is None:  # e.g. fp8 on a torch without it: the meta stand-in has its size
                dtype = {1: torch.uint8, 2: torch.int16}[h.itemsize]
            # Every view of one dtype is a view of one huge meta storage (meta: no bytes).
            base = _meta_bases.get(dtype)
            if base is None:
                base = _meta_bases[dtype] = torch.empty(1 << 48, dtype=dtype, device="meta")
            meta = base.as_strided(tuple(h.shape), tuple(h.strides), h.offset)
            r = torch.Tensor._make_subclass(RecordingTensor, meta, False)
            r._ferry = ft
            return r

        @property
        def ferry(self):
            return self._ferry

        def __repr__(self):
            return f"ferry.RecordingTensor({self._ferry._t.describe()})"

        __str__ = __repr__

        def __format__(self, spec):
            return repr(self)

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = _func_name(func)
            first = args[0] if args else None
            if isinstance(first, RecordingTensor):
                ft = first._ferry
                if name in _FORWARDED:
                    rest = unwrap(tuple(args[1:]))
                    kw = {k: unwrap(v) for k, v in kwargs.items()}
                    attr = getattr(type(ft), name, None)
                    if isinstance(attr, property):
                        return wrap(getattr(ft, name))
                    if name in ("copy_", "zero_", "fill_"):
                        getattr(ft, name)(*rest, **kw)
                        return first
                    if name == "__setitem__":
                        ft.__setitem__(*rest)
                        return None
                    if name == "__iter__":
                        return iter(wrap(ft.unbind(0)))
                    return wrap(getattr(ft, name)(*rest, **kw))
                if name == "is_floating_point":
                    return ft.ferry_dtype.startswith(("F", "BF"))
                if name == "is_complex":
                    return False
                if name in ("is_meta", "is_sparse", "is_quantized", "is_mkldnn"):
                    return name == "is_meta"
                if name == "layout":
                    return torch.strided
                if name == "__hash__":
                    return id(first)
            rec = first_recording(args, kwargs)
            if rec is not None and name == "copy_":
                raise RecordingError(
                    f"copy_: cannot copy recording {rec._ferry._t.describe()} into a real torch tensor; "
                    f"record_load records copies into the module's parameters only")
            target = rec._ferry if rec is not None else first
            qual = name if isinstance(first, torch.Tensor) and hasattr(torch.Tensor, name) else f"torch.{name}"
            if isinstance(target, _tensor.Tensor):
                raise _tensor._needs_values(qual, target)
            raise RecordingError(f"{qual}: needs values of a recording tensor (no bytes)")

    _torch_class = RecordingTensor
    return RecordingTensor


def _metadata_items(metadata):
    """[(name, shape, dtype)] from {name: (shape, dtype)}, {name: TensorDecl}, or an
    iterable of TensorDecls / (name, shape, dtype)."""
    out = []
    if hasattr(metadata, "items"):
        for name, v in metadata.items():
            if isinstance(v, TensorDecl):
                shape, dt = v.shape, v.dtype
            elif hasattr(v, "shape") and hasattr(v, "dtype") and not isinstance(v, tuple):
                shape, dt = v.shape, v.dtype  # a tensor or array: its shape and dtype
            else:
                try:
                    shape, dt = v
                except (TypeError, ValueError):
                    raise InvalidArgumentError(
                        f"record_load: metadata['{name}'] must be (shape, dtype) or a TensorDecl, got {v!r}") from None
            out.append((str(name), shape, dt))
    else:
        for entry in metadata:
            try:
                name, shape, dt = entry
            except (TypeError, ValueError):
                raise InvalidArgumentError(
                    f"record_load: each metadata entry must be (name, shape, dtype) or a TensorDecl, got {entry!r}") from None
            out.append((str(name), shape, dt))
    norm = []
    for name, shape, dt in out:
        try:
            dims = (operator.index(shape),) if not hasattr(shape, "__iter__") else tuple(operator.index(s) for s in shape)
        except TypeError:
            raise InvalidArgumentError(f"record_load: shape of '{name}' must be ints, got {shape!r}") from None
        norm.append((name, dims, dt))
    return norm


def _parameter_slots(module):
    """[(full name, owner module, attribute, parameter)], each parameter once under its
    first name (as named_parameters() names it); a tied parameter's other slots follow
    with the same parameter object."""
    slots = []
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is not None:
                slots.append((f"{mod_name}.{attr}" if mod_name else attr, mod, attr, p))
    return slots


def record_load(module, metadata, load_weights=None, check_coverage=False, allow_unwritten=False, *,
                quantize="none", quantize_params=None):
    """Records ``module``'s own weight loading into a :class:`ferry.Plan`.

    ``metadata``: every checkpoint tensor the loader is fed, ``{name: (shape, dtype)}``
    (also ``{name: TensorDecl}``, a list of TensorDecls or of ``(name, shape, dtype)``).
    For the call, the module's parameters are replaced by recording tensors (torch.Tensor
    subclasses on device ``meta``, keeping every attribute the engine set on them, e.g.
    ``weight_loader``, ``output_dim``); ``load_weights`` (default ``module.load_weights``)
    is called with an iterator of ``(name, recording tensor)`` in metadata order; the real
    parameters are put back afterwards, also when it raises. The plan's params are the
    module's parameter names (``named_parameters()``), with their shapes and dtypes.
    Value-dependent ops raise ``ferry.RecordingError`` naming the op and the tensor.
    ``check_coverage``: also check that every written param element is written exactly
    once (and every element is written, unless ``allow_unwritten``).

    ``quantize`` ("fp8", "fp8-ue8m0", "mxfp8"; default "none") with ``quantize_params``
    (param names, or a callable ``name -> bool``): the engine keeps those params
    block-quantised, as ``Plan.quantized`` says (FP8 quantised on the trainer where it
    can be, the scales as params of their own)."""
    import torch

    if (quantize in (None, "none")) != (quantize_params is None):
        raise InvalidArgumentError("record_load: quantize= and quantize_params= go together "
                                   f"(got quantize={quantize!r}, quantize_params={quantize_params!r})")

    if not isinstance(module, torch.nn.Module):
        raise InvalidArgumentError(f"record_load: module must be a torch.nn.Module, got {type(module).__name__}")
    if load_weights is None:
        load_weights = getattr(module, "load_weights", None)
        if load_weights is None:
            raise InvalidArgumentError(
                f"record_load: {type(module).__name__} has no load_weights; pass load_weights=")
    RecordingTensor = _recording_class()
    items = _metadata_items(metadata)
    slots = _parameter_slots(module)

    recording = {}  # id(real parameter) -> its recording tensor
    swapped = []
    try:
        for name, mod, attr, p in slots:
            rec = recording.get(id(p))
            if rec is None:
                rec = RecordingTensor._wrap(_tensor.param(name, tuple(p.shape), p.dtype))
                rec.__dict__.update({k: v for k, v in vars(p).items() if k != "_ferry"})
                recording[id(p)] = rec
            swapped.append((mod, attr, p))
            mod._parameters[attr] = rec
        sources = [(name, RecordingTensor._wrap(_tensor.source(name, shape, dt))) for name, shape, dt in items]
        with record(check_coverage=check_coverage, allow_unwritten=allow_unwritten) as plan:
            load_weights(iter(sources))
    finally:
        for mod, attr, p in reversed(swapped):
            mod._parameters[attr] = p
    if quantize_params is not None:
        plan = plan.quantized(quantize_params, quantize)
    return plan


def recording_tensor_class():
    """The torch.Tensor subclass record_load hands out (imports torch)."""
    return _recording_class()


__all__ = ["record_load", "Plan"]
