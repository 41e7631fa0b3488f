"""``ferry.serve`` / ``ferry.fetch``: one trainer or one inference rank of a job, run in
the calling process, for any launcher (torchrun, mpirun, srun, Ray, a shell loop). The
same code as the ``ferry serve`` / ``ferry fetch`` commands (src/tools/rank_entry.h): the
ranks meet in the store, sync versions ``first_version .. first_version + syncs - 1``
together, and each call returns one report dict per sync, with the keys of the JSON line
the command prints. See docs/multihost.md, "Rank entry points".
"""
import math
import operator
import os

from . import _ferry
from .errors import CorruptError, InvalidArgumentError, _class_for_code
from ._engine import _store_args

__all__ = ["serve", "fetch"]


def _ms(seconds, what):
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{what}: expected seconds (a number), got {seconds!r}") from None
    ms = s * 1000.0
    if not (math.isfinite(ms) and 1 <= ms <= 2 ** 30):
        raise InvalidArgumentError(f"{what} is {seconds!r} s; it must be between 0.001 and {2 ** 30 // 1000} s")
    return int(round(ms))


def _path(p):
    return None if p is None else os.fspath(p)


def _run(run, role, check, store, token, rank, timeout, rendezvous_timeout, on_report=None, **spec):
    url, token = _store_args(store, token)
    if rank is not None:
        given = rank
        try:
            rank = -1 if isinstance(rank, bool) else operator.index(rank)  # int, numpy integers; not 1.0 or "1"
        except TypeError:
            rank = -1
        if rank < 0:
            raise InvalidArgumentError(f"{role}: rank must be a non-negative int or None (the launcher's), got {given!r}")
    spec.update(store=url, token=token, rank=-1 if rank is None else rank, timeout_ms=_ms(timeout, f"{role}: timeout"),
                rendezvous_ms=_ms(rendezvous_timeout, f"{role}: rendezvous_timeout"))
    if on_report is not None and not callable(on_report):
        raise InvalidArgumentError(f"{role}: on_report must be callable or None, got {on_report!r}")
    reports = run(spec) if on_report is None else run(spec, on_report)
    if check:
        for r in reports:
            if not r["ok"]:
                err = _class_for_code(r.get("code", ""))(f"{role} rank {r['rank']}: version {r['version']}: {r['error']}")
            elif r.get("verified") is False:
                err = CorruptError(f"{role} rank {r['rank']}: version {r['version']} does not equal the checkpoint: "
                                   f"{r['mismatch']}")
            else:
                continue
            err.reports = reports
            raise err
    return reports


def serve(*, store, trainer, inference, checkpoint, model=None, job="ferry", rank=None, mode="pull", checksums=False,
          first_version=1, syncs=1, timeout=30.0, rendezvous_timeout=120.0, token=None, check=False,
          read_checkpoint=False, device="cpu", gpu_staging=False, on_report=None, trace=None):
    """Be trainer rank ``rank`` (None: the launcher's) of the ``trainer`` layout, serving
    its holdings of the safetensors checkpoint directory ``checkpoint`` (memory-mapped
    and served in place; the files must not change while served, checked before each
    sync; ``read_checkpoint=True`` reads them into owned memory instead; ``model``
    defaults to ``checkpoint/config.json``) to the ``inference`` layout's ranks.
    Returns ``[report, ...]``, one dict per sync: the keys of every report (docs/trace.md:
    ``ok, bytes, bytes_sent, sent_in_place, seconds``, the phases' ``*_seconds``, ``dropped,
    missed, failures, error, code``, ...) and ``role, rank, version, transport``. A setup error (layout, rank, checkpoint, store, rendezvous) raises
    the ferry exception of its code with the C++ message; a failed sync does not, unless
    ``check=True`` (then the first failed sync raises after every sync ran, with
    ``.reports``). ``on_report``: called with each sync's dict as soon as that sync
    ends (e.g. to log or to tell the trainer loop); an exception it raises is raised
    once every sync ran (the other ranks are in them too). ``device="cuda:N"``: this
    rank's boxes are copied onto that GPU once and packed there each sync;
    ``gpu_staging=True`` then stages in GPU memory too, shared by CUDA IPC with fetch
    ranks of this host whose params are on a GPU. ``trace``: a path: write this rank's trace
    of every sync there (Chrome trace-event JSON; ``{rank}`` is replaced by the rank)."""
    return _run(_ferry._serve, "serve", check, store, token, rank, timeout, rendezvous_timeout, on_report,
                trainer=str(trainer),
                inference=str(inference), checkpoint=_path(checkpoint), model=_path(model), job=str(job), mode=str(mode),
                checksums=bool(checksums), first_version=int(first_version), syncs=int(syncs),
                read_checkpoint=bool(read_checkpoint), device=str(device), gpu_staging=bool(gpu_staging),
                trace=_path(trace))


def fetch(*, store, trainer, inference, model, checkpoint=None, output=None, job="ferry", rank=None, mode="pull",
          checksums=False, first_version=1, syncs=1, timeout=30.0, rendezvous_timeout=120.0, token=None, check=False,
          device="cpu", cuda_ipc=True, on_report=None, trace=None, leave=False, catch_up=False):
    """Be inference rank ``rank`` (None: the launcher's; in a launch of both roles the
    trainer's ranks come first) of the ``inference`` layout of ``model`` (an HF
    config.json), receiving its shard from the ``trainer`` layout's ranks. ``checkpoint``:
    compare the params with a direct load of that directory after every ok sync
    (``verified``, ``mismatch``); ``output``: write them as ``output/rank-R.safetensors``
    after the last sync when every sync passed. Returns one dict per sync: the keys of every
    report (``bytes, bytes_received, received_into_params, received_via_cuda_ipc, seconds``,
    ...) and ``role, rank, version, torn, transport`` (``verified`` with a checkpoint). Errors as :func:`serve`; with
    ``check=True`` a sync that failed or did not verify raises (``CorruptError`` for a
    mismatch). ``on_report`` as for :func:`serve`. ``device="cuda:N"``: the params live on
    that GPU (``received_via_cuda_ipc``: how many bytes came device to device from serve
    ranks with ``gpu_staging``; ``cuda_ipc=False`` reads through the transport).
    ``trace`` as for :func:`serve`. ``leave=True``: after the last sync, leave the job on
    purpose (scaling in, ``Consumer.leave``): serve ranks name this rank in ``left``, not
    ``missed``; a fetch started later in this rank joins again. ``catch_up=True``: before
    the syncs, join the live version from the inference replicas that hold it
    (``Consumer.catch_up``, a rank joining a running job): its report comes first
    (``catch_up_source``, ``received_from_replicas``); then sync from ``first_version``."""
    return _run(_ferry._fetch, "fetch", check, store, token, rank, timeout, rendezvous_timeout, on_report,
                trainer=str(trainer),
                inference=str(inference), model=_path(model), checkpoint=_path(checkpoint), output=_path(output),
                job=str(job), mode=str(mode), checksums=bool(checksums), first_version=int(first_version),
                syncs=int(syncs), device=str(device), cuda_ipc=bool(cuda_ipc), trace=_path(trace), leave=bool(leave),
                catch_up=bool(catch_up))
