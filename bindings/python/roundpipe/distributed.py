"""Data parallelism across processes (docs/several-machines.md).

Every process (rank) runs its own RoundPipe pipeline on its own share of each batch; before every
optimizer step the engine averages the ranks' gradients over libtorch's c10d while the pipeline
still runs (NCCL in GPU memory for GPU models, Gloo on the host for CPU devices). Give a model
``RoundPipe(..., data_parallel=DataParallel())`` under ``torchrun``, or
``data_parallel=DataParallel.from_process_group()`` where ``torch.distributed`` is already
initialised::

    # torchrun --nproc_per_node 2 train.py
    import torch, roundpipe
    model = roundpipe.RoundPipe(net, data_parallel=roundpipe.DataParallel(global_loss=True))
    rows = slice(4 * model.rank, 4 * model.rank + 4)   # this rank's share of the batch
    loss = model.forward_backward((x[rows],), label=y[rows], loss_fn=loss_fn)
    model.step(step_fn)

What the engine decides (the rank and world size it joined with) is asked of it through
``RoundPipe.rank`` / ``RoundPipe.world_size``; the settings here are passed on to
``rp_model_options_set_data_parallel`` and ``rp_model_options_set_global_loss`` unchanged, and
checked by them.
"""

import datetime
import os
import socket
from ctypes import byref, c_int32
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

from .errors import RoundPipeError, Status

__all__ = ["DataParallel", "data_parallel_available"]

def data_parallel_available() -> bool:
    """Whether the loaded libroundpipe can do data parallelism (it was built with c10d's Gloo
    support; ``rp_data_parallel_available``)."""
    from ._capi import lib
    out = c_int32()
    lib().rp_data_parallel_available(byref(out))
    return bool(out.value)


def _timeout_seconds(timeout):
    """Seconds from a number or a timedelta; None stays None (the engine's default)."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError("timeout must be seconds (a number) or a datetime.timedelta, got %r"
                        % (timeout,))
    timeout = float(timeout)
    # 0 would be the engine's "default"; a timeout here is always explicit
    if not timeout > 0 or timeout != timeout or timeout == float("inf"):
        raise RoundPipeError(Status.INVALID_ARGUMENT,
                             "data parallel timeout must be a positive, finite number of "
                             "seconds, got %r" % (timeout,))
    return timeout


def _int(value, what):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("%s must be an int, got %r" % (what, value))
    return value


@dataclass(frozen=True)
class DataParallel:
    """Data parallelism settings of a model (``RoundPipe(..., data_parallel=...)``).

    Args:
        rank: this process's rank, 0 .. world_size - 1; -1 (default): ``$RANK``.
        world_size: the number of processes; -1 (default): ``$WORLD_SIZE``; 0 turns data
            parallelism off (as passing no ``data_parallel``).
        rendezvous: ``"env://"`` (default; ``$MASTER_ADDR`` and ``$MASTER_PORT``, as torchrun
            sets them) or ``"tcp://host:port"`` (rank 0 hosts the engine's store there).
        timeout: seconds (or a ``datetime.timedelta``) a rank waits for the others, when the
            model is created and in every collective; None (default): the engine's (10
            minutes). A rank that died, hung or failed its call makes the others' calls raise
            RoundPipeError (``Status.IO``) within it (CPU devices and GPUs); the model is
            unusable afterwards (``Status.STATE``) and must be created again on every rank.
        global_loss: report each training call's loss as the mean over the ranks (one small
            collective per call; default False: this rank's own loss).

    The values are checked by the engine when the object is made (RoundPipeError
    ``Status.INVALID_ARGUMENT`` for a rank outside the world, a negative world size, ...; a
    TypeError for a value of the wrong type); the environment and the address are checked when
    the model is created.
    """

    rank: int = -1
    world_size: int = -1
    rendezvous: Optional[str] = "env://"
    timeout: Union[None, float, datetime.timedelta] = None
    global_loss: bool = False

    def __post_init__(self):
        _int(self.rank, "rank")
        _int(self.world_size, "world_size")
        if self.rendezvous is None:
            object.__setattr__(self, "rendezvous", "env://")
        if not isinstance(self.rendezvous, str):
            raise TypeError("rendezvous must be \"env://\" or \"tcp://host:port\", got %r"
                            % (self.rendezvous,))
        object.__setattr__(self, "timeout", _timeout_seconds(self.timeout))
        if not isinstance(self.global_loss, bool):
            raise TypeError("global_loss must be a bool, got %r" % (self.global_loss,))
        # the engine's own checks, on a throwaway rp_model_options
        from ._internals import ModelOptions
        ModelOptions(data_parallel=self.engine_values()).close()

    @property
    def enabled(self) -> bool:
        """False for ``world_size=0`` (data parallelism off)."""
        return self.world_size != 0

    def engine_values(self) -> Tuple[int, int, bytes, int, int]:
        """``(rank, world_size, rendezvous, timeout_ms, global_loss)`` as
        rp_model_options_set_data_parallel and rp_model_options_set_global_loss take them."""
        timeout_ms = 0 if self.timeout is None else max(1, int(round(self.timeout * 1000)))
        return (self.rank, self.world_size, self.rendezvous.encode(), timeout_ms,
                int(self.global_loss))

    @classmethod
    def from_process_group(cls, group: Any = None,
                           timeout: Union[None, float, datetime.timedelta] = None,
                           global_loss: bool = False,
                           host: Optional[str] = None) -> "DataParallel":
        """Settings for the ranks of an initialised ``torch.distributed`` process group (the
        default group, or `group`), used only to agree on a rendezvous: the engine's gradients
        travel through a Gloo group of its own, never through `group`.

        Collective: every rank of `group` must call it. Rank 0 of the group picks a free TCP
        port on its host (binds port 0, then closes the socket: another process could take the
        port before the model is created, in which case creating it fails with RoundPipeError
        ``Status.IO``) and shares ``"tcp://host:port"`` with ``broadcast_object_list``. The host
        is `host` when given; else 127.0.0.1 when every rank runs on the same machine (the ranks
        compare ``socket.gethostname()`` with ``all_gather_object``); else ``$MASTER_ADDR``
        when set; else the address ``socket.gethostname()`` resolves to.

        Returns ``DataParallel(rank=get_rank(group), world_size=get_world_size(group),
        rendezvous="tcp://host:port", timeout=timeout, global_loss=global_loss)``. Create the
        model on every rank soon after (the port is free only for now).
        """
        timeout = _timeout_seconds(timeout)
        try:
            import torch.distributed as dist
        except ImportError as e:  # a torch built without distributed support
            raise RoundPipeError(Status.STATE, "from_process_group needs torch.distributed: "
                                 "%s" % e) from None
        if not dist.is_available() or not dist.is_initialized():
            raise RoundPipeError(Status.STATE, "from_process_group needs an initialised "
                                 "torch.distributed process group (init_process_group first)")
        rank = dist.get_rank(group)
        world_size = dist.get_world_size(group)
        if rank < 0:
            raise RoundPipeError(Status.INVALID_ARGUMENT, "this process is not a member of "
                                 "the process group")
        src = 0 if group is None else dist.get_global_rank(group, 0)
        if host is None:
            names = [None] * world_size
            dist.all_gather_object(names, socket.gethostname(), group=group)
        message = [None]
        if rank == 0:
            if host is None:
                host = _rendezvous_host(one_machine=len(set(names)) == 1)
            message[0] = "tcp://%s:%d" % (_bracketed(host), _free_port(host))
        dist.broadcast_object_list(message, src=src, group=group)
        return cls(rank=rank, world_size=world_size, rendezvous=message[0], timeout=timeout,
                   global_loss=bool(global_loss))


def parse_data_parallel(data_parallel) -> Optional[DataParallel]:
    """The DataParallel of a ``data_parallel=`` argument (None, False: off; True: the defaults,
    from torchrun's environment), or None when off."""
    if data_parallel is None or data_parallel is False:
        return None
    if data_parallel is True:
        data_parallel = DataParallel()
    if not isinstance(data_parallel, DataParallel):
        raise TypeError("data_parallel must be a roundpipe.DataParallel, True or None, got %s"
                        % type(data_parallel).__name__)
    return data_parallel if data_parallel.enabled else None


def _rendezvous_host(one_machine):
    if one_machine:
        return "127.0.0.1"
    addr = os.environ.get("MASTER_ADDR")
    if addr:
        return addr
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        raise RoundPipeError(Status.IO, "from_process_group: cannot resolve this host's name "
                             "%r (%s); pass host=" % (socket.gethostname(), e)) from None


def _bracketed(host):
    return "[%s]" % host if ":" in host and not host.startswith("[") else host


def _free_port(host):
    """A TCP port free on this machine now (the kernel's pick for port 0)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
