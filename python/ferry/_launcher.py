"""Rank and world size from the launcher's environment, when the caller gives none.

Precedence (first found wins): the explicit argument; ``FERRY_RANK`` / ``FERRY_WORLD_SIZE``
(to override a launcher that also starts other processes); torchrun / torch.distributed
(``RANK``, ``WORLD_SIZE``); Open MPI (``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``);
MPICH / Intel MPI (``PMI_RANK``, ``PMI_SIZE``); Slurm (``SLURM_PROCID``, ``SLURM_NTASKS``);
``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` last (one node only); else the default (rank 0).
"""
import os

from .errors import InvalidArgumentError

RANK_VARS = ("FERRY_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "LOCAL_RANK")
WORLD_SIZE_VARS = ("FERRY_WORLD_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS",
                   "LOCAL_WORLD_SIZE")


def _from_env(names, what):
    for name in names:
        value = os.environ.get(name)
        if value is None or value == "":
            continue
        try:
            n = int(value)
        except ValueError:
            raise InvalidArgumentError(f"{what}: environment variable {name}={value!r} is not an integer") from None
        if n < 0:
            raise InvalidArgumentError(f"{what}: environment variable {name}={n} is negative")
        return n, name
    return None, None


def launcher_rank(rank, default=0):
    """``rank`` if given, else the launcher's (see the module docstring), else ``default``."""
    if rank is not None:
        return int(rank)
    n, _ = _from_env(RANK_VARS, "rank")
    return default if n is None else n


def launcher_world_size(world_size, default=None):
    """``world_size`` if given, else the launcher's, else ``default``."""
    if world_size is not None:
        return int(world_size)
    n, _ = _from_env(WORLD_SIZE_VARS, "world size")
    return default if n is None else n
