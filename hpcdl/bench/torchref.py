"""The PyTorch twin of an hpcdl network, for benchmarks that run both side by side."""

from __future__ import annotations

import socket
from typing import Any

import numpy as np

from hpcdl.comm import Communicator
from hpcdl.errors import ConfigError
from hpcdl.nn import Sequential

__all__ = ["init_gloo", "torch_twin"]


def init_gloo(comm: Communicator) -> None:
    """Start ``torch.distributed`` over gloo on ``comm``'s ranks (once; the rendezvous port sent over MPI)."""
    import torch.distributed as dist

    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    else:
        port = None
    port = comm.bcast(port, root=0)
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.Get_rank(), world_size=comm.Get_size()
        )


def torch_twin(model: Sequential, flag: str) -> Any:
    """A ``torch.nn.Sequential`` with the same Linear/ReLU layers and the same initial weights.

    Raises:
        ConfigError: the model has a layer other than Flatten, Linear and ReLU
            (``flag`` names the option in the message).
    """
    import torch

    layers: list[Any] = [torch.nn.Flatten()]
    for layer in model.layers:
        kind = type(layer).__name__
        if kind == "Linear":
            lin = torch.nn.Linear(layer.weight.shape[1], layer.weight.shape[0])
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(np.asarray(layer.weight.data)))
                lin.bias.copy_(torch.from_numpy(np.asarray(layer.bias.data)))
            layers.append(lin)
        elif kind == "ReLU":
            layers.append(torch.nn.ReLU())
        elif kind != "Flatten":
            raise ConfigError(f"{flag} supports Linear/ReLU models (mlp, mlp32); found {kind}")
    return torch.nn.Sequential(*layers)
