"""Process-group helpers for data-parallel training under torchrun.

torchrun (or any launcher) describes the job through environment variables: WORLD_SIZE, RANK,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT. `init` joins that group (gloo for CPU tensors, NCCL
for CUDA ones); without them, or with WORLD_SIZE=1, nothing is initialized and every helper
here acts as the identity of a one-process job, so the same code runs as a plain process.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def env_world_size() -> int:
    """The world size the launcher asked for (1 when not launched as a group)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def is_main() -> bool:
    """Rank 0: the process that logs, evaluates and writes files."""
    return rank() == 0


def backend_for(device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init(device: str | torch.device = "cpu", timeout_minutes: float | None = None) -> torch.device:
    """Join the process group described by the environment, if any, and return this rank's
    device: "cuda" becomes cuda:LOCAL_RANK (one GPU per rank), with the NCCL backend; a CPU
    device takes gloo. A plain process (no WORLD_SIZE, or 1) returns `device` unchanged."""
    device = torch.device(device)
    if env_world_size() <= 1 or is_distributed():
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    kwargs = {}
    if timeout_minutes is not None:
        kwargs["timeout"] = datetime.timedelta(minutes=timeout_minutes)
    dist.init_process_group(backend_for(device), **kwargs)  # reads RANK, WORLD_SIZE, MASTER_* (env://)
    return device


def destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _object_device() -> torch.device:
    # NCCL moves the pickled bytes through the current GPU; gloo through the CPU
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_object(obj, src: int = 0):
    """`obj` of rank `src` on every rank (any picklable object; the others pass anything)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=_object_device())
    return box[0]


def gather_objects(obj, dst: int = 0) -> list | None:
    """[obj of rank 0, obj of rank 1, ...] on rank `dst`, None elsewhere ([obj] in one process)."""
    if not is_distributed():
        return [obj]
    out = [None] * world_size() if rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def all_reduce_sum_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over the ranks, in place (every rank gets the same bits)."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank `src`'s values of `tensor` on every rank, in place."""
    if is_distributed():
        dist.broadcast(tensor, src=src)
    return tensor


def shard_rows(n: int, rank_: int | None = None, world: int | None = None) -> torch.Tensor:
    """This rank's rows of an n-row global batch: rank, rank + world, ... (DistributedSampler's
    strided split). The ranks' shares are disjoint, cover all n rows and differ by at most one
    row; a sorted batch gives every rank rows of similar length. A share may be empty (n < world)."""
    rank_ = rank() if rank_ is None else rank_
    world = world_size() if world is None else world
    return torch.arange(rank_, n, world)
