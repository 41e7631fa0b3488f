"""Plans: recording a loader and replaying it on real memory."""
import collections

from . import _ferry
from .errors import FailedPreconditionError, InvalidArgumentError
from ._tensor import _TORCH_NAMES

TensorDecl = collections.namedtuple("TensorDecl", ["name", "shape", "dtype"])
TensorDecl.__doc__ = "A tensor a plan names: its name, full shape (a tuple) and dtype name (\"bfloat16\", ...)."


class Plan:
    """The exact element map from checkpoint tensors (sources) into one inference rank's
    parameters. Made by ``with ferry.record() as plan:``, or by ``Plan.from_bytes``.
    Immutable; holds names, not data."""

    __slots__ = ("_p",)

    def __init__(self, handle=None):
        self._p = handle

    def _handle(self):
        if self._p is None:
            raise FailedPreconditionError(
                "plan: the recording is not finished; use the plan after the `with ferry.record()` block")
        return self._p

    @classmethod
    def from_bytes(cls, data):
        """Decodes ``to_bytes()`` output (bounds-checked; raises ferry.CorruptError)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"Plan.from_bytes: expects bytes, got {type(data).__name__}")
        return cls(_ferry._Plan.decode(bytes(data)))

    def to_bytes(self):
        """The compact, versioned binary encoding."""
        return self._handle().encode()

    def hash(self):
        """xxHash64 of the encoding: equal for ranks with identical plans."""
        return self._handle().hash()

    def stats(self):
        """dict: copies, zeros, elements, bytes (source bytes read), zero_elements,
        sources, params."""
        return self._handle().stats()

    @property
    def sources(self):
        """{name: TensorDecl} of the checkpoint tensors the plan reads."""
        return _decls(self._handle().sources())

    @property
    def params(self):
        """{name: TensorDecl} of the parameters the plan writes."""
        return _decls(self._handle().params())

    def check_coverage(self, allow_unwritten=False):
        """Raises naming the first param with an element written twice (or by nothing,
        unless allow_unwritten)."""
        self._handle().check_coverage(bool(allow_unwritten))

    def replay(self, sources, params, threads=0, stream=None):
        """Executes the plan: reads ``sources`` and writes ``params`` in place. Both are
        mappings from name to numpy array (buffer protocol) or torch tensor (any dtype
        the plan names, bfloat16 included), C-contiguous, with the declared shape and
        dtype; no copies are made. Entries the plan does not name are ignored. The GIL is
        released while the copies run (``threads``: 0 = one per core for big plans).

        CUDA tensors (all on one device, source and param dtypes equal) replay on the
        GPU in one kernel launch, on ``stream`` (a ``torch.cuda.Stream`` or its
        ``cuda_stream`` int; default: torch's current stream of that device); it returns
        when the copies are done. Needs ferry's CUDA plugin (``ferry devices``)."""
        if stream is not None and hasattr(stream, "cuda_stream"):
            stream = stream.cuda_stream
        self._handle().replay(sources, params, int(threads), stream)

    def __eq__(self, other):
        if not isinstance(other, Plan):
            return NotImplemented
        return self._handle().equals(other._handle())

    __hash__ = object.__hash__

    def quantized(self, params, quantize="fp8"):
        """A copy of this plan that keeps ``params`` (param names, or a callable
        ``name -> bool`` over the plan's params) block-quantised to FP8, as ferry's built-in
        loaders keep their linear weights with the same ``quantize`` ("fp8": 128x128 tiles,
        fp32 ``<name>_scale_inv``; "fp8-ue8m0": power-of-two E8M0 scales; "mxfp8": 1x32
        runs, ``<name>_scale``). A sync then delivers each as e4m3 plus its scales: quantised
        on the trainer where one producer holds a whole tile (``quantize_on="producer"``,
        the default; only the FP8 bytes move), else on the consumer after it lands, bit for
        bit the same either way. Raises InvalidArgumentError naming a name that is not a
        param, a param that is not a float matrix, or an empty selection."""
        if callable(params):
            names = [n for n in self.params if params(n)]
        elif isinstance(params, str):
            raise InvalidArgumentError("Plan.quantized: params must be a list of names or a callable, not one string")
        else:
            names = [str(n) for n in params]
        return Plan(_ferry._mark_quantized(self._handle(), str(quantize), names))

    @property
    def quantized_params(self):
        """{param name: (quantize, block, scale param name)} of the params this plan keeps
        block-quantised (empty unless made by ``quantized`` or a built-in loader with
        quantize=)."""
        return dict(_ferry._quantized_params(self._handle()))

    def dump(self):
        """Human-readable text, one line per copy (for debugging; long for a real model)."""
        return self._handle().to_string()

    def __repr__(self):
        if self._p is None:
            return "ferry.Plan(<recording>)"
        s = self._p.stats()
        return (f"ferry.Plan({s['sources']} sources -> {s['params']} params, {s['copies']} copies, "
                f"{s['bytes']} bytes, hash {self._p.hash():016x})")


def _decls(items):
    return {name: TensorDecl(name, shape, _TORCH_NAMES[dtype]) for name, shape, dtype in items}


class record:
    """``with ferry.record() as plan:`` records every ``param.copy_(source)`` (and
    ``zero_``) made on this thread inside the block; ``plan`` is usable after it.
    Recording is per thread; blocks nest."""

    def __init__(self, check_coverage=False, allow_unwritten=False):
        self._check = check_coverage
        self._allow_unwritten = allow_unwritten
        self._rec = None
        self._plan = None

    def __enter__(self):
        if self._rec is not None:
            raise FailedPreconditionError("record: this recording is already active")
        self._rec = _ferry._Recorder()
        self._plan = Plan()
        return self._plan

    def __exit__(self, exc_type, exc, tb):
        rec, self._rec = self._rec, None
        if exc_type is not None:
            rec.abort()
            return False
        self._plan._p = rec.finish()
        if self._check:
            self._plan.check_coverage(self._allow_unwritten)
        return False
