"""The sync engine from Python: a trainer's WeightSource, Producer, Consumer, StoreServer."""
import os
import secrets
import sys
import warnings

from . import _ferry
from .errors import InvalidArgumentError, UnimplementedError
from ._tensor import dtype_name
from ._models import ModelLoader


def _normalize_metadata(meta):
    """[(name, shape tuple, ferry dtype name)] from {name: (shape, dtype)}, a list of
    (name, shape, dtype), or TensorDecls."""
    items = meta.items() if hasattr(meta, "items") else None
    out = []
    if items is not None:
        for name, v in items:
            if hasattr(v, "shape") and hasattr(v, "dtype") and not isinstance(v, tuple):
                shape, dt = v.shape, v.dtype
            else:
                shape, dt = v[0], v[1]
            out.append((str(name), tuple(int(s) for s in shape), dtype_name(dt)))
    else:
        for entry in meta:
            name, shape, dt = entry[0], entry[1], entry[2]
            out.append((str(name), tuple(int(s) for s in shape), dtype_name(dt)))
    return out


class WeightSource:
    """What a trainer implements to adopt ferry (one object per trainer rank).

    Implement:
      * ``metadata()``: every HF-format tensor of the model — ``{name: (shape, dtype)}``
        (or a list of ``(name, shape, dtype)``); the same on every rank;
      * ``materialize(group)``: this rank's data for layer group ``group`` (see
        ``groups()`` / ``boxes(group)``) — ``{name: array}`` with one numpy array or CPU
        torch tensor per box this rank holds in that group, in HF layout, the box's
        shape, contiguous. They must stay alive and unchanged until the next call.
    and, unless ``layout`` is given (or there is a single rank), ``holdings(rank)``:
    the boxes rank ``rank`` holds — an iterable of ``name`` (the whole tensor) or
    ``(name, start, size)`` (a box: per-dimension start and extent).

    ``layout``: a Megatron ("tp=2,pp=2,ep=2,etp=1,dp=1") or FSDP ("fsdp=8") trainer
    layout; ferry then computes every rank's holdings (``model_config``: the HF config
    dict, needed only for fused-QKV checkpoints such as Phi-3)."""

    def __init__(self, rank=0, world_size=1, layout=None, model_config=None):
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.layout = layout
        self.model_config = model_config
        self._meta = None
        self._computed = None

    # --- to implement ---------------------------------------------------------------
    def metadata(self):
        raise NotImplementedError("WeightSource.metadata()")

    def materialize(self, group):
        raise NotImplementedError("WeightSource.materialize(group)")

    def holdings(self, rank):
        if self.layout is not None:
            if self._computed is None:
                cfg = self.model_config or {}
                heads = cfg.get("num_attention_heads", 0)
                head_dim = cfg.get("head_dim") or (cfg.get("hidden_size", 0) // heads if heads else 0)
                kv = cfg.get("num_key_value_heads", heads)
                self._computed = _ferry._make_holdings(self._metadata(), str(self.layout), heads * head_dim,
                                                       kv * head_dim)
            return self._computed[rank]
        if self.world_size == 1:
            return [name for name, _, _ in self._metadata()]
        raise UnimplementedError("WeightSource.holdings(rank): implement it, or pass layout= to WeightSource.__init__")

    # --- helpers ----------------------------------------------------------------------
    def _metadata(self):
        if self._meta is None:
            self._meta = _normalize_metadata(self.metadata())
        return self._meta

    def groups(self):
        """Group names by id: "pre" (embeddings), "layer 0", ..., "post" (final norm, lm_head)."""
        return list(_ferry._groups(self._metadata())[0])

    def group_of(self, name):
        names = [n for n, _, _ in self._metadata()]
        return _ferry._groups(self._metadata())[1][names.index(name)]

    def boxes(self, group, rank=None):
        """[(name, start, size)] that ``rank`` (default: this rank) holds in ``group``."""
        rank = self.rank if rank is None else rank
        return [b for b in self._ferry_holdings(rank) if self.group_of(b[0]) == group]

    def _ferry_holdings(self, rank):
        shapes = {n: s for n, s, _ in self._metadata()}
        out = []
        for h in self.holdings(rank):
            if isinstance(h, str):
                if h not in shapes:
                    raise InvalidArgumentError(f"holdings({rank}): '{h}' is not in the metadata")
                out.append((h, (0,) * len(shapes[h]), shapes[h]))
            else:
                name, start, size = h
                out.append((str(name), tuple(int(x) for x in start), tuple(int(x) for x in size)))
        return out


def _store_args(store, token):
    if isinstance(store, StoreServer):
        return store.url, token if token is not None else store.token
    if not isinstance(store, str):
        raise InvalidArgumentError(f"store must be a URL (tcp://HOST:PORT, redis://...) or a ferry.StoreServer, got {store!r}")
    return store, token


def _transport_params(transport_params, ucx_config):
    """The transport backend's params (``Transport::backend_info``; for "ucx":
    src/transport/ucx/config.h). ``ucx_config`` (deprecated) is the old form: each UCX
    setting KEY becomes the param ``ucx.KEY``."""
    params = {str(k): str(v) for k, v in (transport_params or {}).items()}
    if ucx_config:
        warnings.warn("ucx_config= is deprecated: pass transport_params={'ucx.KEY': value} "
                      "(or 'tls', 'net_devices', ...)", DeprecationWarning, stacklevel=3)
        for k, v in ucx_config.items():
            params.setdefault("ucx." + str(k), str(v))
    return params


def _options(token, backend, job, mode, timeout, rendezvous_timeout, stall_timeout, lease_ttl, checksums,
             transport_params):
    kw = {"backend": backend, "job": job, "mode": mode, "timeout": float(timeout),
          "rendezvous_timeout": float(rendezvous_timeout), "stall_timeout": float(stall_timeout),
          "lease_ttl": float(lease_ttl), "checksums": bool(checksums)}
    if token is not None:
        kw["token"] = token
    if transport_params:
        kw["transport_params"] = transport_params
    return kw


class StoreServer:
    """The embedded TCP store (rendezvous and membership), served by a thread of this
    process — e.g. on trainer rank 0. ``url`` is what every rank passes as ``store``."""

    def __init__(self, host="127.0.0.1", port=0, token=None):
        self.token = token or os.environ.get("FERRY_TOKEN") or secrets.token_hex(16)
        self._s = _ferry._StoreServer.start(host, int(port), self.token)

    @property
    def url(self):
        return self._s.url

    @property
    def port(self):
        return self._s.port

    def stop(self):
        self._s.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class Producer:
    """A trainer rank's side of the sync. Creation blocks until every producer and
    consumer of the job has published (rendezvous). ``sync(version)`` moves what
    ``source.materialize`` returns now and returns the report (a dict)."""

    def __init__(self, source, store, *, rank=None, token=None, num_consumers=1, num_producers=None,
                 backend="ucx", job="ferry", mode="pull", timeout=30.0, rendezvous_timeout=60.0,
                 stall_timeout=10.0, lease_ttl=3.0, checksums=False, staging_budget=0, transport_params=None,
                 ucx_config=None):
        if not isinstance(source, WeightSource):
            raise InvalidArgumentError("Producer: source must be a ferry.WeightSource")
        url, token = _store_args(store, token)
        kw = _options(token, backend, job, mode, timeout, rendezvous_timeout, stall_timeout, lease_ttl, checksums,
                      _transport_params(transport_params, ucx_config))
        kw["num_consumers"] = int(num_consumers)
        kw["num_producers"] = int(num_producers if num_producers is not None else source.world_size)
        kw["staging_budget"] = int(staging_budget)
        rank = source.rank if rank is None else int(rank)
        self._p = _ferry._Producer(source, source._metadata(), rank, source.world_size, url, kw)

    def sync(self, version):
        """Serves version ``version``; the report: ok, bytes_sent, sent_in_place (bytes is
        the same as bytes_sent), seconds, per-phase seconds,
        bytes_per_peer, dropped consumers, failures, text."""
        return self._p.sync(int(version))

    @property
    def rank(self):
        return self._p.rank

    def close(self):
        self._p.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Consumer:
    """An inference rank's side of the sync. ``model_config`` (path, JSON text or dict)
    with ``layout`` ("tp=2,dp=1,ep=1,replicas=1"), or ``loader`` (a ferry.ModelLoader),
    say what rank ``rank`` holds and how it loads. ``params``: the rank's parameter
    buffers (``loader.params(rank)``: numpy arrays / CPU torch tensors, written in place);
    None: ferry allocates them (see ``params()``)."""

    def __init__(self, model_config=None, layout="tp=1", rank=0, store=None, *, loader=None, params=None,
                 quantize="none", token=None, num_producers=1, num_consumers=None, backend="ucx", job="ferry",
                 mode="pull", timeout=30.0, rendezvous_timeout=60.0, stall_timeout=10.0, lease_ttl=3.0,
                 checksums=False, transport_params=None, ucx_config=None):
        if loader is None:
            if model_config is None:
                raise InvalidArgumentError("Consumer: pass model_config (and layout) or loader")
            loader = ModelLoader(model_config, layout, quantize)
        elif not isinstance(loader, ModelLoader):
            raise InvalidArgumentError("Consumer: loader must be a ferry.ModelLoader")
        if store is None:
            raise InvalidArgumentError("Consumer: store is required")
        url, token = _store_args(store, token)
        kw = _options(token, backend, job, mode, timeout, rendezvous_timeout, stall_timeout, lease_ttl, checksums,
                      _transport_params(transport_params, ucx_config))
        kw["num_producers"] = int(num_producers)
        kw["num_consumers"] = int(num_consumers if num_consumers is not None else loader.world_size)
        self.loader = loader
        self._user_params = params
        self._c = _ferry._Consumer(loader._l, int(rank), url, params, kw)

    def sync(self, version):
        """Receives version ``version`` into the params; the report as a dict (bytes_received,
        received_into_params; bytes is the same as bytes_received). Raises
        (e.g. ferry.PeerFailedError naming the producer) when the sync fails; then
        ``state()["torn"]`` tells whether some groups are already new."""
        return self._c.sync(int(version))

    def state(self):
        """{"version": last complete version or None, "torn": bool}"""
        return self._c.state()

    def params(self):
        """The rank's final params: the ``params`` passed in (when given and not
        quantized), else views of ferry's buffers (torch tensors when torch is imported,
        else numpy arrays; bf16/fp8 as raw uint16/uint8 bits without torch)."""
        if self._user_params is not None and self.loader.final_params(self.rank) == self.loader.params(self.rank):
            return self._user_params
        torch = sys.modules.get("torch")
        out = {}
        for name, (dt, arr) in self._c.params().items():
            if torch is not None:
                if arr.dtype.kind == "u" and arr.dtype.itemsize == 2:  # bf16 bits; torch lacks uint16
                    arr = arr.view("i2")
                t = torch.from_numpy(arr)
                torch_name = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}.get(dt)
                if torch_name is not None and hasattr(torch, torch_name):
                    t = t.view(getattr(torch, torch_name))
                out[name] = t
            else:
                out[name] = arr
        return out

    @property
    def rank(self):
        return self._c.rank

    def close(self):
        self._c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def transport_backends():
    """Transport backends this build supports ("inproc", "ucx")."""
    return list(_ferry._transport_backends())
