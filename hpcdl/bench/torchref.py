"""The PyTorch twin of an hpcdl network, for benchmarks that run both side by side."""

from __future__ import annotations

import functools
import socket
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from hpcdl.comm import Communicator
from hpcdl.errors import ConfigError
from hpcdl.nn import (
    AvgPool2d,
    BasicBlock,
    BatchNorm1d,
    BatchNorm2d,
    Bottleneck,
    Conv2d,
    Dropout,
    Flatten,
    GlobalAvgPool2d,
    Layer,
    Linear,
    MaxPool2d,
    ReLU,
    ResidualBlock,
    Sequential,
)

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
    """A ``torch.nn.Module`` computing what ``model`` computes, from the same weights.

    Each layer becomes its PyTorch counterpart (:data:`_TWINS`), a ``Sequential`` a
    ``torch.nn.Sequential`` and a residual block a module with the same main branch and
    shortcut, under the names ``model.state_dict()`` uses (``3.weight``,
    ``4.shortcut.1.running_mean``), so that the parameters and BatchNorm's running
    statistics are copied by name, exactly, in the dtype of ``model``'s parameters (float32
    when it has none). Each module starts in its layer's mode (``training``), so Dropout
    and BatchNorm behave as in ``model``; Dropout's masks are PyTorch's own draws.

    Args:
        model: the network, or a slice of it (a pipeline stage: the names are the slice's).
        flag: the option that asked for the twin, for the error message.

    Returns:
        The twin, a ``torch.nn.Sequential``.

    Raises:
        ConfigError: ``model`` has a layer without a PyTorch counterpart.
    """
    import torch

    net = _twin(torch.nn, model, flag)
    state = model.state_dict()
    dtype = next(iter(state.values())).dtype if state else np.dtype(np.float32)
    net.to(getattr(torch, dtype.name))  # before the copy: float64 weights stay exact
    tensors = {name: torch.from_numpy(value) for name, value in state.items()}
    missing, unexpected = net.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]  # PyTorch's own counter
    if missing or unexpected:  # a builder named a part otherwise: a bug here, not the user's
        raise RuntimeError(f"torch_twin: names unlike hpcdl's: missing {missing}, unexpected {unexpected}")
    return net


#: builds one layer's counterpart: ``(torch.nn, layer, twin of a child layer) -> module``
_Builder = Callable[[Any, Any, Callable[[Layer], Any]], Any]


def _twin(nn: Any, layer: Layer, flag: str) -> Any:
    """``layer``'s counterpart (its children's too), in ``layer``'s mode."""
    build = _TWINS.get(type(layer))
    if build is None:
        known = ", ".join(sorted(cls.__name__ for cls in _TWINS))
        raise ConfigError(
            f"{flag}: layer {layer.name!r} is a {type(layer).__name__}, which has no PyTorch twin "
            f"(twins exist for {known}): time a model built of those, or add one in hpcdl/bench/torchref.py"
        )
    module = build(nn, layer, lambda child: _twin(nn, child, flag))
    module.training = layer.training  # this module only: each child took its own layer's mode
    return module


def _sequential(nn: Any, layer: Sequential, child: Callable[[Layer], Any]) -> Any:
    # hpcdl's child names (positions, or a stage's positions in the whole model)
    return nn.Sequential(OrderedDict((name, child(sub)) for name, sub in zip(layer._children, layer.layers)))


def _residual(nn: Any, layer: ResidualBlock, child: Callable[[Layer], Any]) -> Any:
    main = OrderedDict((name, child(getattr(layer, name))) for name in layer._main)
    shortcut = None if layer.shortcut is None else child(layer.shortcut)
    return _residual_class()(main, shortcut)


def _linear(nn: Any, layer: Linear, _: Any) -> Any:
    return nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)


def _conv2d(nn: Any, layer: Conv2d, _: Any) -> Any:
    return nn.Conv2d(
        layer.in_channels,
        layer.out_channels,
        layer.kernel_size,
        stride=layer.stride,
        padding=layer.padding,
        bias=layer.bias is not None,
    )


def _batchnorm(nn: Any, layer: BatchNorm1d | BatchNorm2d, _: Any) -> Any:
    # the same momentum convention (running = (1 - momentum) running + momentum batch, the
    # variance unbiased), so the values carry over unchanged
    kind = nn.BatchNorm2d if isinstance(layer, BatchNorm2d) else nn.BatchNorm1d
    return kind(layer.num_features, eps=layer.eps, momentum=layer.momentum)


def _maxpool2d(nn: Any, layer: MaxPool2d, _: Any) -> Any:
    return nn.MaxPool2d(layer.kernel_size, layer.stride, layer.padding)  # -inf padding in both


def _avgpool2d(nn: Any, layer: AvgPool2d, _: Any) -> Any:
    return nn.AvgPool2d(layer.kernel_size, layer.stride, layer.padding)  # zeros counted in both


def _global_avgpool2d(nn: Any, _layer: GlobalAvgPool2d, _: Any) -> Any:
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())  # N, C, H, W -> N, C


def _flatten(nn: Any, _layer: Flatten, _: Any) -> Any:
    return nn.Flatten()


def _relu(nn: Any, _layer: ReLU, _: Any) -> Any:
    return nn.ReLU()  # not in place: a pipeline stage may start with a ReLU on its received input


def _dropout(nn: Any, layer: Dropout, _: Any) -> Any:
    return nn.Dropout(layer.p)


#: the PyTorch counterpart of each layer class (the exact class: a subclass may compute otherwise)
_TWINS: dict[type[Layer], _Builder] = {
    Sequential: _sequential,
    BasicBlock: _residual,
    Bottleneck: _residual,
    Linear: _linear,
    Conv2d: _conv2d,
    BatchNorm1d: _batchnorm,
    BatchNorm2d: _batchnorm,
    MaxPool2d: _maxpool2d,
    AvgPool2d: _avgpool2d,
    GlobalAvgPool2d: _global_avgpool2d,
    Flatten: _flatten,
    ReLU: _relu,
    Dropout: _dropout,
}


@functools.cache
def _residual_class() -> type:
    """The ``torch.nn.Module`` of a residual block (defined on first use: torch is optional)."""
    import torch

    class ResidualTwin(torch.nn.Module):
        """``relu(main(x) + shortcut(x))``, as :class:`hpcdl.nn.ResidualBlock`, with its child names."""

        def __init__(self, main: OrderedDict[str, Any], shortcut: Any) -> None:
            super().__init__()
            self.main_names = tuple(main)
            for name, module in main.items():
                self.add_module(name, module)
            self.shortcut = shortcut  # None: the identity
            self.relu_out = torch.nn.ReLU()

        def forward(self, x: Any) -> Any:
            h = x  # N, Cin, H, W
            for name in self.main_names:
                h = getattr(self, name)(h)  # N, Cout, Ho, Wo at the end
            s = x if self.shortcut is None else self.shortcut(x)  # N, Cout, Ho, Wo
            return self.relu_out(h + s)  # N, Cout, Ho, Wo

    return ResidualTwin
