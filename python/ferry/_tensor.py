"""Recording tensors with torch's view API.

A :class:`Tensor` made by :func:`source` (a checkpoint tensor) or :func:`param` (an
inference parameter) has a dtype and a shape but no bytes. View ops (``narrow``,
indexing, ``view``, ``transpose``, ``chunk``, ...) work as in torch; ``param.copy_(src)``
inside ``with ferry.record() as plan:`` records the element map. Anything that needs
values raises :class:`ferry.RecordingError` naming the op and the tensor.

torch interop without depending on torch: when torch is already imported, ``.shape``
is a ``torch.Size`` and ``.dtype`` a ``torch.dtype``; otherwise a tuple and a dtype name
("bfloat16"). ``torch.narrow(t, ...)``, ``torch.chunk(t, ...)`` etc. dispatch to the
view ops through ``__torch_function__``; other torch functions raise RecordingError.
"""
import operator
import sys

from . import _ferry
from .errors import RecordingError, InvalidArgumentError, OutOfRangeError

# ferry (safetensors) dtype name -> torch / numpy name.
_TORCH_NAMES = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
    "U8": "uint8", "BOOL": "bool",
}


def dtype_name(dtype):
    """The ferry name ("BF16", ...) of a torch dtype, numpy dtype or string
    ("bfloat16", "torch.float16", "F32", "fp8", ...)."""
    if isinstance(dtype, str):
        name = dtype
    elif type(dtype).__module__ == "torch" or type(dtype).__name__ == "dtype" and str(dtype).startswith("torch."):
        name = str(dtype)
    elif hasattr(dtype, "name") and hasattr(dtype, "itemsize"):  # numpy dtype
        name = dtype.name
    elif isinstance(dtype, type) and dtype.__module__ == "numpy":  # numpy.float32
        name = dtype.__name__
    else:
        raise InvalidArgumentError(f"unknown dtype {dtype!r}")
    if name.startswith("torch."):
        name = name[6:]
    return _ferry.dtype_name(name)


def _torch():
    return sys.modules.get("torch")


def _shape_args(args, op):
    """view(2, 3), view((2, 3)), view([2, 3]) and view(torch.Size([2, 3]))."""
    if len(args) == 1 and not isinstance(args[0], int) and hasattr(args[0], "__iter__"):
        args = tuple(args[0])
    try:
        return [operator.index(a) for a in args]
    except TypeError:
        raise InvalidArgumentError(f"{op}: sizes must be ints, got {args!r}") from None


def _needs_values(op, t):
    return RecordingError(
        f"{op}: needs values but {t._t.describe()} is recording (no bytes); a recorded loader "
        f"can only take views (narrow, indexing, view, transpose, chunk, ...) and copy_ them into params")


def _value_op(name):
    def op(self, *args, **kwargs):
        raise _needs_values(name, self)
    op.__name__ = name
    return op


class Tensor:
    """A recording tensor (see the module docstring). Make one with :func:`source` or
    :func:`param`."""

    # No __slots__: loaders hang attributes on params (vLLM's weight_loader, output_dim).

    def __init__(self, handle):
        if not isinstance(handle, _ferry._Tensor):
            raise InvalidArgumentError("use ferry.source(...) or ferry.param(...) to make a tensor")
        self._t = handle

    # --- metadata -------------------------------------------------------------------
    @property
    def name(self):
        """The name of the source or param this tensor views."""
        return self._t.name

    @property
    def kind(self):
        """"source" or "param"."""
        return self._t.kind

    @property
    def shape(self):
        torch = _torch()
        return torch.Size(self._t.shape) if torch is not None else self._t.shape

    @property
    def dtype(self):
        name = _TORCH_NAMES[self._t.dtype]
        torch = _torch()
        if torch is not None and hasattr(torch, name):
            return getattr(torch, name)
        return name

    @property
    def ferry_dtype(self):
        """The ferry (safetensors) dtype name: "BF16", "F32", ..."""
        return self._t.dtype

    @property
    def ndim(self):
        return self._t.ndim

    @property
    def data(self):
        return self

    @property
    def device(self):
        torch = _torch()
        return torch.device("meta") if torch is not None else "meta"

    @property
    def is_cuda(self):
        return False

    @property
    def requires_grad(self):
        return False

    @property
    def T(self):
        return self.permute(*reversed(range(self.ndim)))

    @property
    def nbytes(self):
        return self._t.numel * self._t.itemsize

    def dim(self):
        return self._t.ndim

    ndimension = dim

    def size(self, dim=None):
        if dim is None:
            return self.shape
        d = operator.index(dim)
        n = self._t.ndim
        if not -n <= d < n:
            raise OutOfRangeError(f"size: dim {d} out of range for {n}-d {self._t.describe()}")
        return self._t.shape[d]

    def stride(self, dim=None):
        s = self._t.strides
        if dim is None:
            return s
        d = operator.index(dim)
        if not -len(s) <= d < len(s):
            raise OutOfRangeError(f"stride: dim {d} out of range for {len(s)}-d {self._t.describe()}")
        return s[d]

    def storage_offset(self):
        return self._t.offset

    def numel(self):
        return self._t.numel

    nelement = numel

    def element_size(self):
        return self._t.itemsize

    def is_contiguous(self, memory_format=None):
        return self._t.is_contiguous

    def __len__(self):
        if self._t.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self._t.shape[0]

    def __repr__(self):
        return f"ferry.Tensor({self._t.describe()})"

    __hash__ = object.__hash__

    # --- views ----------------------------------------------------------------------
    def narrow(self, dim, start, length):
        return Tensor(self._t.narrow(operator.index(dim), operator.index(start), operator.index(length)))

    def select(self, dim, index):
        return Tensor(self._t.select(operator.index(dim), operator.index(index)))

    def view(self, *shape):
        if len(shape) == 1 and not isinstance(shape[0], int) and not hasattr(shape[0], "__iter__"):
            raise _needs_values("view(dtype)", self)  # a reinterpretation of bytes
        return Tensor(self._t.view(_shape_args(shape, "view")))

    def reshape(self, *shape):
        return Tensor(self._t.reshape(_shape_args(shape, "reshape")))

    def view_as(self, other):
        return self.view(other.shape)

    def reshape_as(self, other):
        return self.reshape(other.shape)

    def transpose(self, dim0, dim1):
        return Tensor(self._t.transpose(operator.index(dim0), operator.index(dim1)))

    swapaxes = transpose
    swapdims = transpose

    def t(self):
        return Tensor(self._t.t())

    def permute(self, *dims):
        return Tensor(self._t.permute(_shape_args(dims, "permute")))

    def flatten(self, start_dim=0, end_dim=-1):
        return Tensor(self._t.flatten(operator.index(start_dim), operator.index(end_dim)))

    def unflatten(self, dim, sizes):
        return Tensor(self._t.unflatten(operator.index(dim), _shape_args((sizes,), "unflatten")))

    def unsqueeze(self, dim):
        return Tensor(self._t.unsqueeze(operator.index(dim)))

    def squeeze(self, dim=None):
        if isinstance(dim, (tuple, list)):
            t = self
            for d in sorted((operator.index(x) % max(self.ndim, 1) for x in dim), reverse=True):
                t = t.squeeze(d)
            return t
        return Tensor(self._t.squeeze(None if dim is None else operator.index(dim)))

    def chunk(self, chunks, dim=0):
        return tuple(Tensor(p) for p in self._t.chunk(operator.index(chunks), operator.index(dim)))

    def split(self, split_size_or_sections, dim=0):
        if isinstance(split_size_or_sections, int) or hasattr(split_size_or_sections, "__index__"):
            parts = self._t.split(operator.index(split_size_or_sections), operator.index(dim))
        else:
            parts = self._t.split_sizes(_shape_args((split_size_or_sections,), "split"), operator.index(dim))
        return tuple(Tensor(p) for p in parts)

    def tensor_split(self, *args, **kwargs):
        raise _needs_values("tensor_split", self)

    def unbind(self, dim=0):
        return tuple(Tensor(p) for p in self._t.unbind(operator.index(dim)))

    def contiguous(self, memory_format=None):
        return Tensor(self._t.contiguous())

    def detach(self):
        return self

    def cpu(self):
        return self

    def cuda(self, *args, **kwargs):
        return self

    def to(self, *args, **kwargs):
        """A no-op for devices and for the tensor's own dtype; converting to another dtype
        needs values (copy_ into a param of that dtype converts float dtypes instead)."""
        dtype = kwargs.get("dtype")
        for a in args:
            if isinstance(a, Tensor) or (hasattr(a, "dtype") and hasattr(a, "shape")):
                dtype = a.dtype
            elif not isinstance(a, str) and type(a).__name__ == "dtype":
                dtype = a
        if dtype is not None and dtype_name(dtype) != self._t.dtype:
            raise _needs_values(f"to({dtype})", self)
        return self

    def __iter__(self):
        if self._t.ndim == 0:
            raise TypeError("iteration over a 0-d tensor")
        return iter(self.unbind(0))

    def __getitem__(self, index):
        return Tensor(_index(self, index))

    # --- writes ---------------------------------------------------------------------
    def copy_(self, src, non_blocking=False):
        """Records ``self <- src`` (src a recording source; numels equal, elements matched
        in row-major order; float dtypes convert on replay). Returns self."""
        if not isinstance(src, Tensor):
            raise RecordingError(
                f"copy_: cannot record a copy of real values ({type(src).__name__}) into {self._t.describe()}; "
                f"a recorded loader may only copy from ferry.source tensors")
        self._t.copy_(src._t)
        return self

    def zero_(self):
        """Records explicit zeros (padding) in a param. Returns self."""
        self._t.zero_()
        return self

    def fill_(self, value):
        if isinstance(value, (int, float, bool)) and value == 0:
            return self.zero_()
        raise _needs_values(f"fill_({value!r})", self)

    def __setitem__(self, index, value):
        view = Tensor(_index(self, index))
        if isinstance(value, Tensor):
            view.copy_(value)
        elif isinstance(value, (int, float, bool)) and value == 0:
            view.zero_()
        else:
            raise RecordingError(
                f"setitem: cannot record a copy of real values ({type(value).__name__}) into "
                f"{view._t.describe()}; assign a ferry.source view or 0")

    # --- torch dispatch ---------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        first = args[0] if args else None
        if isinstance(first, Tensor) and name in _TORCH_VIEW_FUNCTIONS:
            return getattr(first, name)(*args[1:], **kwargs)
        tensor = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, Tensor)), None)
        if tensor is None:  # e.g. inside a list argument (torch.cat([...]))
            for a in list(args) + list(kwargs.values()):
                if isinstance(a, (list, tuple)):
                    tensor = next((x for x in a if isinstance(x, Tensor)), None)
                    if tensor is not None:
                        break
        if name == "copy_" and tensor is not None:
            raise RecordingError(
                f"copy_: cannot copy recording {tensor._t.describe()} into a real torch tensor; "
                f"under ferry.record() the destination must be a ferry.param")
        raise _needs_values(f"torch.{name}", tensor if tensor is not None else first)

    def __getattr__(self, name):
        # Everything else a torch.Tensor has (sum, float, add_, ...) needs values.
        if not name.startswith("_"):
            torch = _torch()
            if name in _VALUE_METHODS or (torch is not None and hasattr(torch.Tensor, name)):
                return _value_op(name).__get__(self)
        raise AttributeError(f"'ferry.Tensor' object has no attribute '{name}'")


_TORCH_VIEW_FUNCTIONS = {
    "narrow", "select", "reshape", "transpose", "swapaxes", "swapdims", "t", "permute", "flatten",
    "unflatten", "unsqueeze", "squeeze", "chunk", "split", "unbind", "view", "view_as", "reshape_as",
    "contiguous", "detach", "numel", "dim", "size", "stride", "is_contiguous", "zero_", "fill_",
    "__getitem__", "__setitem__", "copy_", "to", "cpu", "cuda",
}

_VALUE_METHODS = {
    "item", "tolist", "numpy", "sum", "mean", "max", "min", "abs", "clamp", "clone", "float",
    "half", "bfloat16", "double", "int", "long", "bool", "byte", "add", "add_", "sub", "sub_",
    "mul", "mul_", "div", "div_", "matmul", "equal", "allclose", "any", "all", "norm", "type",
    "data_ptr", "untyped_storage", "storage", "repeat", "expand", "index_select", "gather",
    "masked_fill", "where", "argmax", "argmin", "sort", "topk", "eq", "ne", "lt", "le", "gt", "ge",
}

# Operators and conversions that need values.
for _name, _op in [
    ("__add__", "add"), ("__radd__", "add"), ("__iadd__", "add_"), ("__sub__", "sub"),
    ("__rsub__", "sub"), ("__isub__", "sub_"), ("__mul__", "mul"), ("__rmul__", "mul"),
    ("__imul__", "mul_"), ("__truediv__", "div"), ("__rtruediv__", "div"), ("__itruediv__", "div_"),
    ("__floordiv__", "floor_divide"), ("__rfloordiv__", "floor_divide"), ("__mod__", "remainder"),
    ("__pow__", "pow"), ("__rpow__", "pow"), ("__matmul__", "matmul"), ("__rmatmul__", "matmul"),
    ("__neg__", "neg"), ("__pos__", "positive"), ("__abs__", "abs"), ("__invert__", "bitwise_not"),
    ("__and__", "bitwise_and"), ("__or__", "bitwise_or"), ("__xor__", "bitwise_xor"),
    ("__lshift__", "bitwise_left_shift"), ("__rshift__", "bitwise_right_shift"),
    ("__eq__", "eq"), ("__ne__", "ne"), ("__lt__", "lt"), ("__le__", "le"), ("__gt__", "gt"),
    ("__ge__", "ge"), ("__bool__", "bool"), ("__float__", "float"), ("__int__", "int"),
    ("__index__", "index"), ("__complex__", "complex"), ("__array__", "numpy"),
    ("item", "item"), ("tolist", "tolist"), ("numpy", "numpy"),
]:
    setattr(Tensor, _name, _value_op(_op))
del _name, _op
Tensor.__hash__ = object.__hash__


def _index(t, index):
    """Basic indexing: ints, slices (positive steps), None, Ellipsis."""
    if not isinstance(index, tuple):
        index = (index,)
    h = t._t
    ndim = h.ndim
    consumed = 0
    ellipses = 0
    for i in index:
        if i is Ellipsis:
            ellipses += 1
        elif i is not None:
            consumed += 1
    if ellipses > 1:
        raise OutOfRangeError(f"getitem: an index can only have a single ellipsis ({t._t.describe()})")
    if consumed > ndim:
        raise OutOfRangeError(f"getitem: too many indices ({consumed}) for {ndim}-d {t._t.describe()}")
    expanded = []
    for i in index:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (ndim - consumed))
        else:
            expanded.append(i)
    d = 0
    for i in expanded:
        if i is None:
            h = h.unsqueeze(d)
            d += 1
        elif isinstance(i, slice):
            step = 1 if i.step is None else _int_index(i.step, t)
            if step <= 0:
                raise InvalidArgumentError(f"getitem: step must be greater than zero, got {step} ({t._t.describe()})")
            start = None if i.start is None else _int_index(i.start, t)
            stop = None if i.stop is None else _int_index(i.stop, t)
            h = h.slice(d, start, stop, step)
            d += 1
        elif (isinstance(i, bool) or not hasattr(i, "__index__") or isinstance(i, Tensor)
              or len(getattr(i, "shape", ())) > 0):
            raise RecordingError(
                f"getitem: indexing with {type(i).__name__} (advanced indexing, a gather) is not a view of "
                f"{t._t.describe()}; ferry records views only (ints, slices, None, ...)")
        else:
            h = h.select(d, _int_index(i, t))
    return h


def _int_index(v, t):
    try:
        return operator.index(v)
    except TypeError:
        raise RecordingError(
            f"getitem: index {v!r} is not an int; ferry records views only ({t._t.describe()})") from None


def _shape_of(shape):
    if isinstance(shape, int):
        return [shape]
    return [operator.index(s) for s in shape]


def source(name, shape, dtype):
    """A recording checkpoint tensor (a source of copies): its HF name, full shape, dtype
    (torch dtype, numpy dtype, or a name: "bfloat16", "float32", "BF16", ...)."""
    return Tensor(_ferry._Tensor.source(str(name), _shape_of(shape), dtype_name(dtype)))


def param(name, shape, dtype):
    """A recording inference parameter (the destination of copies)."""
    return Tensor(_ferry._Tensor.param(str(name), _shape_of(shape), dtype_name(dtype)))
