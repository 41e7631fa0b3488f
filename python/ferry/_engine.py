"""The sync engine from Python: a trainer's WeightSource, Producer, Consumer, StoreServer."""
import inspect
import os
import secrets
import sys
import warnings

from . import _ferry
from .errors import FailedPreconditionError, InvalidArgumentError, UnimplementedError
from ._tensor import dtype_name
from ._models import ModelLoader
from ._plan import TensorDecl
from ._launcher import launcher_rank, launcher_world_size


def _normalize_metadata(meta):
    """[(name, shape tuple, ferry dtype name)] from {name: (shape, dtype)}, {name: TensorDecl},
    {name: array}, or a list of (name, shape, dtype) / TensorDecls."""
    dtypes = {}  # dtype -> ferry name: tens of thousands of tensors share a handful of dtypes

    def dt_name(dt):
        key = str(dt)
        if key not in dtypes:
            dtypes[key] = dtype_name(dt)
        return dtypes[key]

    out = []
    if hasattr(meta, "items"):
        for name, v in meta.items():
            if isinstance(v, TensorDecl) or not isinstance(v, (tuple, list)):  # TensorDecl, array, tensor
                shape, dt = v.shape, v.dtype
            else:
                shape, dt = v[0], v[1]
            out.append((str(name), tuple(int(s) for s in shape), dt_name(dt)))
    else:
        for entry in meta:
            name, shape, dt = entry[0], entry[1], entry[2]
            out.append((str(name), tuple(int(s) for s in shape), dt_name(dt)))
    return out


class WeightSource:
    """What a trainer implements to adopt ferry (one object per trainer rank).

    Implement:
      * ``metadata()``: every HF-format tensor of the model — ``{name: (shape, dtype)}``,
        ``{name: TensorDecl}`` or a list of ``(name, shape, dtype)`` / ``TensorDecl``; the
        same on every rank; called once;
      * ``materialize(group)``: this rank's data for layer group ``group`` (see
        ``groups()`` / ``boxes(group)``) — ``{name: array}`` with one numpy array or CPU
        torch tensor per box this rank holds in that group (a list, in holdings order,
        when it holds several boxes of that tensor), of the box's shape, in HF element
        order. Any strides: a view of the trainer's own tensor (a row range of a fused
        ``linear_qkv``, a column range of a weight) is read where it lies, no copy. They
        must stay alive and unchanged until the next call (with ``in_place=True`` on the
        Producer: at the same address for every sync, see ``Producer``).
    and, unless ``layout`` is given (or there is a single rank), ``holdings(rank)``:
    the boxes rank ``rank`` holds — an iterable of ``name`` (the whole tensor) or
    ``(name, start, size)`` (a box: per-dimension start and extent). It is asked once per
    rank; the answer is cached.

    ``layout``: a Megatron ("tp=2,pp=2,ep=2,etp=1,dp=1") or FSDP ("fsdp=8") trainer
    layout; ferry then computes every rank's holdings (``model_config``: the HF config
    dict, needed only for fused-QKV checkpoints such as Phi-3). ``ferry.megatron``
    describes Megatron-Core's own tensors (padded vocab, fused ``linear_qkv``).

    ``rank`` / ``world_size`` default to the launcher's environment (``RANK`` /
    ``WORLD_SIZE``, Open MPI's, Slurm's: see ferry._launcher), else 0 / 1."""

    def __init__(self, rank=None, world_size=None, layout=None, model_config=None):
        self.rank = launcher_rank(rank)
        self.world_size = launcher_world_size(world_size, default=1)
        if not 0 <= self.rank < self.world_size:
            raise InvalidArgumentError(f"WeightSource: rank {self.rank} is outside world_size {self.world_size}")
        self.layout = layout
        self.model_config = model_config
        self._meta = None
        self._index = None        # name -> metadata index
        self._group_names = None  # group id -> "pre" | "layer N" | "post"
        self._tensor_group = None  # metadata index -> group id
        self._layout_holdings = None
        self._held = {}           # rank -> [(name, start, size)]
        self._by_group = {}       # rank -> {group id: [(name, start, size)]}

    # --- to implement ---------------------------------------------------------------
    def metadata(self):
        raise NotImplementedError("WeightSource.metadata()")

    def materialize(self, group):
        raise NotImplementedError("WeightSource.materialize(group)")

    def holdings(self, rank):
        if self.layout is not None:
            if self._layout_holdings is None:
                cfg = self.model_config or {}
                heads = cfg.get("num_attention_heads", 0)
                head_dim = cfg.get("head_dim") or (cfg.get("hidden_size", 0) // heads if heads else 0)
                kv = cfg.get("num_key_value_heads", heads)
                # Every rank's holdings are computed once in C++; a rank's boxes cross into
                # Python only when asked for.
                self._layout_holdings = _ferry._LayoutHoldings(self._metadata(), str(self.layout), heads * head_dim,
                                                               kv * head_dim)
            return self._layout_holdings.rank(int(rank))
        if self.world_size == 1:
            return [name for name, _, _ in self._metadata()]
        raise UnimplementedError("WeightSource.holdings(rank): implement it, or pass layout= to WeightSource.__init__")

    # --- helpers ----------------------------------------------------------------------
    def _metadata(self):
        if self._meta is None:
            meta = _normalize_metadata(self.metadata())
            index = {}
            for i, (name, _, _) in enumerate(meta):
                if name in index:
                    raise InvalidArgumentError(f"metadata(): tensor '{name}' is listed twice")
                index[name] = i
            self._meta, self._index = meta, index
        return self._meta

    def _grouping(self):
        if self._group_names is None:
            names, of_tensor = _ferry._groups(self._metadata())
            self._group_names, self._tensor_group = list(names), list(of_tensor)
        return self._group_names, self._tensor_group

    def groups(self):
        """Group names by id: "pre" (embeddings), "layer 0", ..., "post" (final norm, lm_head)."""
        return list(self._grouping()[0])

    def group_of(self, name):
        """The group id of tensor ``name``."""
        self._metadata()
        i = self._index.get(name)
        if i is None:
            raise InvalidArgumentError(f"group_of: '{name}' is not in the metadata")
        return self._grouping()[1][i]

    def boxes(self, group, rank=None):
        """[(name, start, size)] that ``rank`` (default: this rank) holds in ``group``."""
        rank = self.rank if rank is None else int(rank)
        by_group = self._by_group.get(rank)
        if by_group is None:
            of_tensor = self._grouping()[1]
            by_group = {}
            for b in self._ferry_holdings(rank):
                by_group.setdefault(of_tensor[self._index[b[0]]], []).append(b)
            self._by_group[rank] = by_group
        return list(by_group.get(group, ()))

    def _ferry_holdings(self, rank):
        held = self._held.get(rank)
        if held is not None:
            return held
        meta = self._metadata()
        index = self._index
        held = []
        for h in self.holdings(rank):
            if isinstance(h, str):
                i = index.get(h)
                if i is None:
                    raise InvalidArgumentError(f"holdings({rank}): '{h}' is not in the metadata")
                shape = meta[i][1]
                held.append((h, (0,) * len(shape), shape))
            else:
                name, start, size = h
                name = str(name)
                if name not in index:
                    raise InvalidArgumentError(f"holdings({rank}): '{name}' is not in the metadata")
                held.append((name, tuple(int(x) for x in start), tuple(int(x) for x in size)))
        self._held[rank] = held
        return held


def _takes_error(hook):
    """Whether an after_sync hook takes the sync's error: ``after_sync(version, error)``
    (a second positional parameter, with or without a default, or ``*args``). A hook of
    the one-argument form ``after_sync(version)`` is called that way, on failure too."""
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):  # no signature to read (some builtins): the old form
        return False
    try:
        signature.bind(0, None)
    except TypeError:
        return False
    return True


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


def _metrics_handle(metrics):
    """The C++ object of a ferry.Metrics (None: none); anything else is refused there."""
    from ._metrics import Metrics
    return metrics._m if isinstance(metrics, Metrics) else metrics


def _target_job(job, target):
    """The engine job of target ``target`` of ``job`` ("{job}#{target}", docs/targets.md);
    ``job`` itself for None or "" (the main model)."""
    if target is None or target == "":
        return job  # (the binding checks it, naming `job`)
    if not isinstance(target, str):
        raise InvalidArgumentError(f"target must be a str, got {type(target).__name__}")
    if not isinstance(job, str):
        raise InvalidArgumentError(f"job must be a str, got {type(job).__name__}")
    return _ferry._target_job(job, target)


class AdapterSlots:
    """One inference rank's slot table for a LoRA adapter target (docs/targets.md): each
    ``sync(version)`` receives only the adapter's weights (``plan``, e.g.
    ``ferry.record_load`` of the engine's LoRA loader) into buffers no reader sees, copies
    them into a slot neither serving nor held, and switches with every rank of
    ``switch_group`` at once (the decision is one for all: ``"switch"``, ``"keep"`` when no
    rank's bytes changed, ``"abort"`` when any rank did not receive it: the previous
    version keeps serving everywhere). Slots are named ``"{adapter}@{version}"``.

    Readers: ``with slots.acquire() as lease:`` (None before the first switch) gives
    ``lease.name``, ``lease.version`` and ``lease.params()`` ({name: read-only numpy array},
    bf16 as raw uint16 bits), one version, whole, for as long as the lease is held; a held
    slot is never written. ``switch_group``: the consumer ranks that switch together
    (default: every consumer of the job); ``switch_timeout``: seconds a rank waits for the
    others' votes; ``slot_wait``: seconds a sync waits for a reader to let go of an old
    slot. The other keywords are the Consumer's (``job``, ``target`` (default
    ``"lora-" + adapter``; pass one for an adapter name over 59 bytes), ``token``,
    ``num_producers``, ``num_consumers``, ``backend``, timeouts, ``checksums``, ...).
    Adapter versions increase: a version at or below one already decided is refused
    (sync a rollback under a new number)."""

    def __init__(self, plan, rank=None, store=None, *, adapter, slots=2, switch_group=None, switch_timeout=30.0,
                 slot_wait=5.0, token=None, num_producers=1, num_consumers=None, backend="ucx", job="ferry",
                 target=None, mode="pull", timeout=30.0, rendezvous_timeout=60.0, stall_timeout=10.0, lease_ttl=3.0,
                 checksums=True, failover=True, group_order="rotated", transport_params=None, ucx_config=None,
                 metrics=None):
        from ._plan import Plan
        from ._launcher import launcher_rank, launcher_world_size

        if not isinstance(plan, Plan):
            raise InvalidArgumentError(f"AdapterSlots: plan must be a ferry.Plan, got {type(plan).__name__}")
        if store is None:
            raise InvalidArgumentError("AdapterSlots: store is required")
        if not isinstance(adapter, str):
            raise InvalidArgumentError("AdapterSlots: adapter must be a str")
        for name, value in (("switch_timeout", switch_timeout), ("slot_wait", slot_wait)):
            if not isinstance(value, (int, float)) or value < 0 or value != value or value == float("inf"):
                raise InvalidArgumentError(f"AdapterSlots: {name} must be finite seconds >= 0, got {value!r}")
        job = _target_job(job, "lora-" + adapter if target is None else target)
        rank = launcher_rank(rank)
        if num_consumers is None:
            num_consumers = launcher_world_size(None, default=1)
        group = [] if switch_group is None else [int(r) for r in switch_group]
        url, token = _store_args(store, token)
        kw = _options(token, backend, _transport_params(transport_params, ucx_config), job=job, mode=mode,
                      timeout=timeout, rendezvous_timeout=rendezvous_timeout, stall_timeout=stall_timeout,
                      lease_ttl=lease_ttl, checksums=checksums, failover=failover, group_order=group_order,
                      num_producers=num_producers, num_consumers=num_consumers, commit="in_place",
                      metrics=_metrics_handle(metrics))
        self.job = job
        self._a = _ferry._AdapterSlots(plan._handle(), int(rank), url, kw, adapter, int(slots), group,
                                       float(switch_timeout), float(slot_wait))

    def sync(self, version):
        """Receives ``version`` and switches with the group; a dict: ``decision``
        ("switch", "keep", "abort"), ``ok`` (not aborted), ``unchanged`` (this rank's bytes
        equal what it serves), ``serving`` (the serving slot's name after it), ``slot``,
        ``report`` (the adapter consumer's sync report: bytes, failures). An aborted
        version is not an exception (the old adapter serves); a store that cannot say the
        decision is."""
        return self._a.sync(int(version))

    def acquire(self):
        """The serving slot, held (an ``AdapterLease``, a context manager); None before any
        version switched."""
        lease = self._a.acquire()
        return None if lease is None else AdapterLease(lease)

    def slots(self):
        """[{slot, name, version, serving, readers}] as now."""
        return self._a.slots()

    def close(self):
        """Releases the rank's transport and store; refused while leases are held."""
        self._a.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AdapterLease:
    """A reader's hold on one adapter version (AdapterSlots.acquire). Each view from
    ``params()`` holds the slot too, for as long as the view exists: ``release()`` (or the
    end of ``with``) drops the lease's own hold, and the slot is free once the views are
    gone as well (``AdapterSlots.close()`` refuses while any is held)."""

    def __init__(self, lease):
        self._l = lease

    @property
    def name(self):
        return self._l.name

    @property
    def version(self):
        return self._l.version

    @property
    def slot(self):
        return self._l.slot

    def params(self):
        """{name: read-only numpy array over the slot} (bf16 as raw uint16 bits)."""
        return {name: view for name, (_, view) in self._l.params().items()}

    def release(self):
        self._l.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _options(token, backend, transport_params, **engine):
    """The binding's keywords: the engine's options as given (the binding checks each one
    and raises InvalidArgumentError naming it), the transport's, the store's token."""
    kw = {"backend": backend, **engine}
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
    ``source.materialize`` returns now and returns the report (a dict).

    ``in_place=True`` serves the trainer's tensors where they lie: at creation every
    group is materialized once and the memory of what it returns (a torch tensor's
    whole storage; a numpy array's bytes) is registered with the transport; consumers
    then read each contiguous box (a whole parameter, a row range of a fused
    ``linear_qkv`` or ``linear_fc1``, the unpadded rows of a vocab shard) straight from
    there, with no copy into staging, for every piece of at least ``direct_min_bytes``
    (default 64 KiB; 0: every piece). Strided boxes (a column range) are still packed.
    The promise: every box stays at the same address, and is not written while
    ``sync()`` runs (an optimizer updating parameters in place between syncs is fine;
    one that rebinds ``p.data`` is not: that sync fails naming the tensor). The report's
    ``sent_in_place`` counts the bytes so served.

    ``rank`` defaults to ``source.rank``; ``num_producers`` to ``source.world_size``.
    Timeouts are seconds; ``float('inf')`` means unbounded. Every keyword, its default and
    meaning: docs/python.md, "Producer and Consumer keywords"; a value of the wrong type
    or out of range raises InvalidArgumentError naming the keyword."""

    def __init__(self, source, store, *, rank=None, token=None, num_consumers=1, num_producers=None,
                 backend="ucx", job="ferry", mode="pull", timeout=30.0, rendezvous_timeout=60.0,
                 stall_timeout=10.0, straggler_floor=2.0, straggler_factor=8.0, join_window=20.0, lease_ttl=3.0,
                 checksums=False, failover=True, group_order="rotated", convert_on="producer", quantize_on="producer",
                 delta=False, delta_full_every=0, delta_block_bytes=0, delta_same_host=False, staging_budget=0, staging_device="cpu", in_place=False, direct_min_bytes=64 * 1024,
                 transport_params=None, ucx_config=None, metrics=None, weight_digests=False, target=None):
        if not isinstance(source, WeightSource):
            raise InvalidArgumentError("Producer: source must be a ferry.WeightSource")
        job = _target_job(job, target)
        url, token = _store_args(store, token)
        kw = _options(token, backend, _transport_params(transport_params, ucx_config), job=job, mode=mode,
                      timeout=timeout, rendezvous_timeout=rendezvous_timeout, stall_timeout=stall_timeout,
                      straggler_floor=straggler_floor, straggler_factor=straggler_factor, join_window=join_window,
                      lease_ttl=lease_ttl, checksums=checksums, failover=failover, group_order=group_order,
                      convert_on=convert_on, quantize_on=quantize_on, delta=delta, delta_full_every=delta_full_every,
                      delta_block_bytes=delta_block_bytes, delta_same_host=delta_same_host,
                      num_consumers=num_consumers,
                      num_producers=num_producers if num_producers is not None else source.world_size,
                      staging_budget=staging_budget, staging_device=staging_device, in_place=bool(in_place),
                      metrics=_metrics_handle(metrics), weight_digests=weight_digests)
        if direct_min_bytes is not None:  # None: the default (as before 64 KiB was spelled out)
            kw["direct_min_bytes"] = direct_min_bytes
        rank = source.rank if rank is None else int(rank)
        self._p = _ferry._Producer(source, source._metadata(), rank, source.world_size, url, kw)

    def sync(self, version, trace=None):
        """Serves version ``version``; the report: ok, bytes_sent, sent_in_place (bytes is
        the same as bytes_sent), seconds, per-phase seconds,
        bytes_per_peer, dropped consumers, failures, text (the same keys as every
        report: docs/trace.md). ``trace``: a path: write this sync's trace there (Chrome
        trace-event JSON; also when the sync fails). A failed sync raises a ferry.Error
        whose ``report`` is the sync's report as far as it went."""
        return self._p.sync(int(version), None if trace is None else os.fspath(trace))

    @property
    def rank(self):
        return self._p.rank

    @property
    def closed(self):
        """Whether ``close()`` ran: every later ``sync`` raises FailedPreconditionError."""
        return self._p.closed

    def close(self):
        """Leaves the job: releases the rank's lease, transport and registered memory. A
        ``sync`` running on another thread is waited for. Idempotent; every later use but
        ``rank`` / ``closed`` raises FailedPreconditionError."""
        self._p.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Consumer:
    """An inference rank's side of the sync. What rank ``rank`` holds and how it loads is
    one of:

      * ``plan`` (a ferry.Plan, e.g. ``ferry.record_load(module, metadata)``: the engine's
        own loader, recorded) with ``params``, the engine's own parameters (a mapping name
        -> CPU torch tensor / numpy array, or an ``nn.Module`` whose ``named_parameters()``
        are used), written in place; plan params missing from ``params`` are allocated by
        ferry (zeroed; see ``params()``). ``post_process(group_name, params)`` (optional)
        runs on the consumer's background thread once every param of a layer group
        ("pre", "layer N", "post") landed in a sync, with ``{name: param}`` of that group;
        an exception fails the sync with its message;
      * ``model_config`` (path, JSON text or dict) with ``layout``
        ("tp=2,dp=1,ep=1,replicas=1"), or ``loader`` (a ferry.ModelLoader): ferry's
        built-in loader; ``params``: ``loader.params(rank)`` buffers, or None (allocated).

    ``rank`` / ``num_consumers`` default to the launcher's environment (RANK / WORLD_SIZE,
    ...: see ferry._launcher); with ``loader``, num_consumers defaults to the layout's
    world size. Hooks, with the GIL held: ``before_sync(version)`` and
    ``after_sync(version, error=None)`` on the thread calling ``sync`` (before anything
    moves; once the sync is over), ``after_group(version, group_id)`` on the background
    thread after a group is unpacked and post-processed. before_sync and after_sync pair:
    every sync whose before_sync returned runs after_sync exactly once, also when the sync
    raises; ``error`` is then the exception ``sync`` raises (None when the version was
    committed). An after_sync that takes one argument, ``after_sync(version)``, is called
    that way, on failure too. A sync refused before before_sync (closed, a re-bound
    param) or whose before_sync raised runs no after_sync. An exception in a hook fails
    that sync with the hook's error (after_group's and after_sync's once the version has
    landed: ``state()`` tells), except that after_sync raising on a failed sync does not
    replace the sync's error: it is added to it as a note. Durations are in seconds;
    ``float('inf')``: no bound.

    Each sync checks that every param registered at creation is still where it was: a
    param re-bound since (``p.data = new_tensor``, or a mapping entry replaced) would
    leave the engine writing the old memory, so sync raises FailedPreconditionError
    naming it (create a new Consumer for the new memory, or copy into the old one); the
    check is the engine's (Consumer::check_params).

    Every keyword, its default and meaning: docs/python.md, "Producer and Consumer
    keywords"; a value of the wrong type or out of range raises InvalidArgumentError
    naming the keyword."""

    def __init__(self, model_config=None, layout="tp=1", rank=None, store=None, *, loader=None, plan=None,
                 params=None, post_process=None, before_sync=None, after_group=None, after_sync=None,
                 commit="in_place", before_commit=None, after_commit=None, quantize="none", token=None,
                 num_producers=1, num_consumers=None, backend="ucx", job="ferry",
                 mode="pull", timeout=30.0, rendezvous_timeout=60.0, stall_timeout=10.0, lease_ttl=3.0,
                 checksums=False, failover=True, group_order="rotated", convert_on="producer", quantize_on="producer", delta=False,
                 delta_same_host=False,
                 cuda_ipc=True, relay=False,
                 direct_min_bytes=64 * 1024, transport_params=None,
                 ucx_config=None, metrics=None, weight_digests=False, check_weights_each_sync=False, target=None):
        from ._plan import Plan
        from ._launcher import launcher_rank, launcher_world_size

        if plan is not None:
            if not isinstance(plan, Plan):
                raise InvalidArgumentError(f"Consumer: plan must be a ferry.Plan, got {type(plan).__name__}")
            if loader is not None or model_config is not None:
                raise InvalidArgumentError("Consumer: pass plan= or model_config/loader=, not both")
        elif loader is None:
            if model_config is None:
                raise InvalidArgumentError("Consumer: pass plan= (e.g. ferry.record_load(...)), model_config (and layout) "
                                           "or loader")
            loader = ModelLoader(model_config, layout, quantize)
        elif not isinstance(loader, ModelLoader):
            raise InvalidArgumentError("Consumer: loader must be a ferry.ModelLoader")
        if post_process is not None and plan is None:
            raise InvalidArgumentError("Consumer: post_process= goes with plan= (a built-in loader post-processes itself)")
        for hook_name, hook in (("post_process", post_process), ("before_sync", before_sync),
                                ("after_group", after_group), ("after_sync", after_sync),
                                ("before_commit", before_commit), ("after_commit", after_commit)):
            if hook is not None and not callable(hook):
                raise InvalidArgumentError(f"Consumer: {hook_name} must be callable, got {type(hook).__name__}")
        if store is None:
            raise InvalidArgumentError("Consumer: store is required")
        job = _target_job(job, target)
        rank = launcher_rank(rank)
        if num_consumers is None:
            num_consumers = loader.world_size if loader is not None else launcher_world_size(None, default=1)
        url, token = _store_args(store, token)
        kw = _options(token, backend, _transport_params(transport_params, ucx_config), job=job, mode=mode,
                      timeout=timeout, rendezvous_timeout=rendezvous_timeout, stall_timeout=stall_timeout,
                      lease_ttl=lease_ttl, checksums=checksums, failover=failover, group_order=group_order,
                      convert_on=convert_on, quantize_on=quantize_on, delta=delta, delta_same_host=delta_same_host,
                      cuda_ipc=cuda_ipc, relay=relay,
                      num_producers=num_producers, num_consumers=num_consumers, commit=commit,
                      metrics=_metrics_handle(metrics), weight_digests=weight_digests,
                      check_weights_each_sync=check_weights_each_sync)
        if direct_min_bytes is not None:  # None: the default, as on the Producer
            kw["direct_min_bytes"] = direct_min_bytes
        if after_group is not None:
            kw["after_group"] = after_group
        if commit == "groups":  # run by the engine around each layer group's commit
            if before_commit is not None:
                kw["before_commit"] = before_commit
            if after_commit is not None:
                kw["after_commit"] = after_commit
        self.loader = loader
        self.plan = plan
        self._before_sync, self._after_sync = before_sync, after_sync
        self._before_commit, self._after_commit = before_commit, after_commit
        self._shadow = commit == "shadow"
        self._after_sync_takes_error = after_sync is not None and _takes_error(after_sync)
        self._params_owner = params  # a mapping, or a module (re-read at each sync)
        mapping = self._current_params()
        if plan is not None:
            self._c = _ferry._Consumer.from_plan(plan._handle(), int(rank), url, mapping, post_process, kw)
        else:
            self._c = _ferry._Consumer(loader._l, int(rank), url, mapping, kw)

    def _current_params(self):
        owner = self._params_owner
        if owner is None:
            return None
        if hasattr(owner, "named_parameters") and not hasattr(owner, "keys"):
            return dict(owner.named_parameters())
        if not hasattr(owner, "keys") or not hasattr(owner, "__getitem__"):
            raise InvalidArgumentError(
                f"Consumer: params must be a mapping name -> tensor or an nn.Module, got {type(owner).__name__}")
        return owner

    def sync(self, version, trace=None, commit=True):
        """Receives version ``version`` into the params; the report as a dict (bytes_received,
        received_into_params; bytes is the same as bytes_received; the same keys as every
        report: docs/trace.md). ``trace``: a path: write this sync's trace there (Chrome
        trace-event JSON; also when the sync fails). Raises
        (e.g. ferry.PeerFailedError naming the producer) when the sync fails, the error's
        ``report`` the sync's report as far as it went (its failures, events,
        ``groups_live``, ``live_version``); then ``state()["torn"]`` / ``["mixed"]`` tell
        whether some groups are already new (and ``committed_versions`` says so). ``after_sync`` runs
        whenever ``before_sync`` did, given the error when the sync raised (see the class).

        ``commit`` (``commit="shadow"`` only): False returns once the version is received,
        verified and post-processed into the shadow, the live params untouched; then
        ``commit()`` or ``discard()``. True (the default) commits at the end, between
        ``before_commit`` and ``after_commit`` (the report's ``commit_seconds``)."""
        self._live("sync")
        # Each param registered at creation still where the engine writes it (re-binding).
        self._c.check_params(self._current_params())
        version = int(version)
        trace = None if trace is None else os.fspath(trace)
        if self._before_sync is not None:
            self._before_sync(version)
        # From here on after_sync runs, whatever happens (a generation lock taken in
        # before_sync is released), and is told what went wrong.
        try:
            report = self._c.sync(version, trace, False if self._shadow else bool(commit))
            if self._shadow and commit:
                report["commit_seconds"] = self.commit()
                report["committed"] = True
                report["live_version"] = version
        except BaseException as error:
            if self._after_sync is not None:
                try:
                    self._call_after_sync(version, error)
                except BaseException as hook_error:  # noqa: BLE001 - the sync's error stays the one raised
                    note = f"after_sync({version}) also raised: {type(hook_error).__name__}: {hook_error}"
                    if hasattr(error, "add_note"):
                        error.add_note(note)
                    else:  # Python < 3.11
                        warnings.warn(note, RuntimeWarning, stacklevel=2)
            raise
        if self._after_sync is not None:
            self._call_after_sync(version, None)
        return report

    def commit(self):
        """``commit="shadow"``: makes the received version live in one step (a flip of
        ferry's two buffer sets, or a copy per param into yours), between
        ``before_commit(version)`` and ``after_commit(version)`` (where a serving engine
        takes and releases the lock its forward passes hold). The seconds it took.
        FailedPreconditionError when no version is received."""
        self._live("commit")
        received = self._c.state()["received"]
        if received is None:
            return self._c.commit()  # raises, saying why
        if self._before_commit is not None:
            self._before_commit(received)
        try:
            return self._c.commit()
        finally:
            if self._after_commit is not None:
                self._after_commit(received)

    def discard(self):
        """``commit="shadow"``: drops the received version; the live params stay."""
        self._live("discard")
        self._c.discard()

    @property
    def committed_version(self):
        """The version the live params hold (None before the first commit)."""
        return self.state()["version"]

    @property
    def received_version(self):
        """``commit="shadow"``: a version received and not committed yet, else None."""
        return self.state()["received"]

    def _call_after_sync(self, version, error):
        if self._after_sync_takes_error:
            self._after_sync(version, error)
        else:
            self._after_sync(version)

    def _live(self, method):
        if self._c.closed:
            raise FailedPreconditionError(f"Consumer.{method}: the consumer is closed")

    def check_weights(self):
        """The weight checker (``weight_digests=True`` on every rank): {"version": the live
        version checked, "ok", "changed": params whose live bytes changed since the version
        went live, "drifted": boxes two trainer replicas hold whose digests differ (each line
        names both producers, the param and the box), "bytes_checked", "bytes", "coverage",
        "replicated_boxes", "replicated_checked", "text"}. Between syncs."""
        self._live("check_weights")
        return self._c.check_weights()

    def state(self):
        """{"version": the committed version (what the live params hold) or None, "torn":
        bool, "mixed": bool (commit="groups": a failed sync left some layer groups at a newer
        version, each whole), "received": a version received and not committed (shadow) or
        None}"""
        return self._c.state()

    def params(self):
        """The rank's final params: the ``params`` passed in where given (and, with a built-in
        loader, not quantized; with ``plan``, not among ``plan.quantized_params``), else
        views of ferry's buffers (torch tensors when torch is
        imported, else numpy arrays; bf16/fp8 as raw uint16/uint8 bits without torch); a
        param in GPU memory is the caller's tensor (None for one ferry made there).

        Views of ferry's own buffers stay readable after ``close()`` in mode pull (they keep
        the memory); in push those buffers are the transport's and go with it: copy them
        first. After ``close()`` this raises FailedPreconditionError."""
        self._live("params")
        given = self._current_params()
        if given is not None and self.loader is not None and \
                self.loader.final_params(self.rank) == self.loader.params(self.rank):
            return given
        torch = sys.modules.get("torch")
        out = {}
        # A param the plan keeps block-quantised is ferry's e4m3 buffer, not the caller's
        # (which has the loaded dtype); its scales are ferry's too.
        kept_fp8 = set(self.plan.quantized_params) if self.plan is not None else ()
        for name, (dt, arr) in self._c.params().items():
            if (self.plan is not None or arr is None) and given is not None and name in given and name not in kept_fp8:
                out[name] = given[name]
                continue
            if arr is None:  # in GPU memory and not the caller's (a post-processing output)
                out[name] = None
                continue
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

    @property
    def closed(self):
        """Whether ``close()`` ran: every later ``sync``, ``state`` or ``params`` raises
        FailedPreconditionError (``rank`` stays readable)."""
        return self._c.closed

    def close(self):
        """Releases the rank's lease, transport and ferry's own param buffers (in push;
        in pull views from ``params()`` keep theirs). A ``sync`` running on another thread
        is waited for. Idempotent. Producers count a closed rank as missing from later
        syncs (``missed``) until it comes back; to scale in, ``leave()`` first."""
        self._c.close()

    def leave(self):
        """Leaves the job on purpose, between syncs (scaling in): marks the rank as left,
        then gives up its lease and its claim on the rank. Producers neither wait for it
        nor report it missed (their reports name it in ``left``); its params stay as they
        are, and it syncs no more (``sync`` raises FailedPreconditionError). A new
        ``Consumer`` of the same rank joins the job again. Then ``close()``."""
        self._live("leave")
        self._c.leave()

    def catch_up(self, trace=None):
        """Joins the live version now, between syncs, from the replicas that hold it (a new
        or restarted instance of this rank; docs/elastic.md): the newest version any
        inference rank committed is read from the live params of a replica of this rank's
        layout (not from the trainer), post-processed here as a sync would, and made live.
        The report as a dict (``received_from_replicas``: every byte of it;
        ``catch_up_source``: the replica's rank; ``version``). Raises ferry.NotFoundError
        when no replica of this layout holds the live version (nothing changed: the next
        ``sync`` brings it from the trainer); the last replica's error when none could
        serve it (then ``state()["torn"]``). Host params only. ``trace``: as for ``sync``."""
        self._live("catch_up")
        return self._c.catch_up(None if trace is None else os.fspath(trace))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class CommittedVersion(int):
    """A version an inference rank committed (an ``int``), and whether a failed sync left
    its params not whole since: ``mixed`` (commit="groups": some layer groups live at
    ``newer``, each whole) or ``torn`` (in place: some groups partly new). ``whole`` is
    neither. Its repr says so: ``1 (mixed with 2)``."""

    def __new__(cls, version, mixed=False, torn=False, newer=None):
        self = int.__new__(cls, version)
        self.mixed, self.torn, self.newer = bool(mixed), bool(torn), newer
        return self

    @property
    def whole(self):
        return not self.mixed and not self.torn

    def __repr__(self):
        if self.whole:
            return int.__repr__(self)
        return "%d (%s %s %s)" % (self, "mixed" if self.mixed else "torn", "with" if self.mixed else "by", self.newer)

    __str__ = __repr__


def committed_states(store, num_consumers, *, job="ferry", token=None, target=None):
    """What each inference rank 0..num_consumers-1 of ``job`` (its target ``target``, if
    given) serves, from the store: a dict {"version": committed last or None, "mixed":
    bool, "torn": bool, "newer": the version a failed sync left partly live, or None}."""
    job = _target_job(job, target)
    url, token = _store_args(store, token)
    kw = {"token": token} if token is not None else {}
    return [{"version": v, "mixed": m, "torn": t, "newer": n}
            for v, m, t, n in _ferry._committed_states(url, kw, str(job), int(num_consumers))]


def adapter_serving(store, num_consumers, *, job="ferry", target, token=None):
    """What each inference rank 0..num_consumers-1 of adapter target ``target`` (e.g.
    ``"lora-math"``) of ``job`` serves, as its ``AdapterSlots`` recorded after its last
    decision: ``"math@7"``, or None for a rank that serves none yet. (``committed_versions``
    of the same target says what each rank *received*: an aborted or kept version leaves it
    ahead of what the rank serves.)"""
    job = _target_job(job, target)
    url, token = _store_args(store, token)
    kw = {"token": token} if token is not None else {}
    return list(_ferry._adapter_serving(url, kw, job, int(num_consumers)))


def committed_versions(store, num_consumers, *, job="ferry", token=None, target=None):
    """The version each inference rank 0..num_consumers-1 of ``job`` committed last (None
    for one that has committed none), from the store. The job-wide live version is the
    minimum; ask before serving with new weights. Each is a :class:`CommittedVersion`: an
    int that says (``mixed``, ``torn``, its repr) when a failed sync left that rank's
    params not whole."""
    return [None if s["version"] is None else CommittedVersion(s["version"], s["mixed"], s["torn"], s["newer"])
            for s in committed_states(store, num_consumers, job=job, token=token, target=target)]


def transport_backends():
    """Transport backends this build supports ("inproc", "ucx")."""
    return list(_ferry._transport_backends())
