"""ResNet residual blocks: ``BasicBlock`` and ``Bottleneck``.

The projection shortcut, when there is one, is a ``Sequential`` child named
``shortcut`` holding a 1x1 convolution and a BatchNorm, so its parameters are
``shortcut.0.weight``, ``shortcut.1.weight``, ``shortcut.1.running_mean``, ...
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from hpcdl.nn.activation import ReLU
from hpcdl.nn.conv import Conv2d
from hpcdl.nn.hooks import call
from hpcdl.nn.init import default_rng
from hpcdl.nn.layer import Layer
from hpcdl.nn.norm import BatchNorm2d
from hpcdl.nn.sequential import Sequential

__all__ = ["BasicBlock", "Bottleneck", "ResidualBlock"]


class ResidualBlock(Layer):
    """``y = relu(main(x) + shortcut(x))``, with ``main`` a chain of child layers.

    Subclasses set ``self._main`` (the attribute names of the main branch, in
    order) and ``self.shortcut`` (a ``Sequential`` projection or ``None`` for
    the identity). Child layers are called through :func:`hpcdl.nn.hooks.call` one level
    deeper: a profile sees the block as a whole, a ``nested`` observer (K-FAC) each layer.
    """

    _main: tuple[str, ...] = ()
    shortcut: Sequential | None = None

    def _finish(self) -> None:
        """Register the children (main branch, shortcut, final ReLU) once built."""
        self.relu_out = ReLU()
        short = ("shortcut",) if self.shortcut is not None else ()
        self._children = (*self._main, *short, "relu_out")
        self.assign_names()

    def forward(self, x: Any) -> Any:
        h = x  # N, Cin, H, W
        for attr in self._main:
            h = call(getattr(self, attr), "forward", h)  # N, Cout, Ho, Wo at the end
        s = x  # N, Cin, H, W
        for layer in self.shortcut or ():
            s = call(layer, "forward", s)  # N, Cout, Ho, Wo at the end
        h += s  # N, Cout, Ho, Wo (h is a fresh BatchNorm output)
        return call(self.relu_out, "forward", h)  # N, Cout, Ho, Wo

    def backward(self, gy: Any) -> Any:
        g = call(self.relu_out, "backward", gy)  # N, Cout, Ho, Wo
        gs = g  # N, Cout, Ho, Wo
        for layer in reversed(self.shortcut.layers if self.shortcut is not None else []):
            gs = call(layer, "backward", gs)  # N, Cin, H, W at the end
        gh = g  # N, Cout, Ho, Wo
        for attr in reversed(self._main):
            gh = call(getattr(self, attr), "backward", gh)  # N, Cin, H, W at the end
        gh += gs  # N, Cin, H, W (gh is a fresh convolution gradient)
        return gh


class BasicBlock(ResidualBlock):
    """ResNet-18/34 block: 3x3 conv, BN, ReLU, 3x3 conv, BN, add the shortcut, ReLU.

    The shortcut is a 1x1 convolution (stride ``stride``) and a BatchNorm when
    ``stride != 1`` or the channel count changes, else the identity.
    Convolutions have no bias (a BatchNorm follows each).

    Args:
        in_channels: Input channels.
        out_channels: Output channels.
        stride: Stride of the first convolution (and of the projection).
        rng: Stream for the weight initialisation (default ``default_rng(0)``).
        dtype: Parameter dtype.
        xp: Array module.
    """

    expansion = 1

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        stride: int = 1,
        *,
        rng: np.random.Generator | None = None,
        dtype: Any = np.float32,
        xp: ModuleType = np,
    ) -> None:
        super().__init__()
        rng = default_rng(rng)
        kw = {"rng": rng, "dtype": dtype, "xp": xp}
        self.in_channels, self.out_channels, self.stride = in_channels, out_channels, stride
        self.conv1 = Conv2d(in_channels, out_channels, 3, stride, 1, bias=False, **kw)
        self.bn1 = BatchNorm2d(out_channels, dtype=dtype, xp=xp)
        self.relu1 = ReLU()
        self.conv2 = Conv2d(out_channels, out_channels, 3, 1, 1, bias=False, **kw)
        self.bn2 = BatchNorm2d(out_channels, dtype=dtype, xp=xp)
        self._main = ("conv1", "bn1", "relu1", "conv2", "bn2")
        if stride != 1 or in_channels != out_channels:
            self.shortcut = Sequential(
                [
                    Conv2d(in_channels, out_channels, 1, stride, 0, bias=False, **kw),
                    BatchNorm2d(out_channels, dtype=dtype, xp=xp),
                ]
            )
        self._finish()

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, stride={self.stride}"


class Bottleneck(ResidualBlock):
    """ResNet-50 block: 1x1 conv, BN, ReLU, 3x3 conv (stride), BN, ReLU, 1x1 conv, BN, add, ReLU.

    The output has ``mid_channels * expansion`` channels; the stride sits on
    the 3x3 convolution (torchvision's "ResNet v1.5"). The shortcut is a 1x1
    convolution and a BatchNorm when ``stride != 1`` or the channel count
    changes, else the identity.

    Args:
        in_channels: Input channels.
        mid_channels: Channels of the 1x1 and 3x3 convolutions inside.
        stride: Stride of the 3x3 convolution (and of the projection).
        expansion: Output channels per inner channel.
        rng: Stream for the weight initialisation (default ``default_rng(0)``).
        dtype: Parameter dtype.
        xp: Array module.
    """

    def __init__(
        self,
        in_channels: int,
        mid_channels: int,
        stride: int = 1,
        expansion: int = 4,
        *,
        rng: np.random.Generator | None = None,
        dtype: Any = np.float32,
        xp: ModuleType = np,
    ) -> None:
        super().__init__()
        rng = default_rng(rng)
        kw = {"rng": rng, "dtype": dtype, "xp": xp}
        out_channels = mid_channels * expansion
        self.in_channels, self.mid_channels, self.out_channels = in_channels, mid_channels, out_channels
        self.stride, self.expansion = stride, expansion
        self.conv1 = Conv2d(in_channels, mid_channels, 1, 1, 0, bias=False, **kw)
        self.bn1 = BatchNorm2d(mid_channels, dtype=dtype, xp=xp)
        self.relu1 = ReLU()
        self.conv2 = Conv2d(mid_channels, mid_channels, 3, stride, 1, bias=False, **kw)
        self.bn2 = BatchNorm2d(mid_channels, dtype=dtype, xp=xp)
        self.relu2 = ReLU()
        self.conv3 = Conv2d(mid_channels, out_channels, 1, 1, 0, bias=False, **kw)
        self.bn3 = BatchNorm2d(out_channels, dtype=dtype, xp=xp)
        self._main = ("conv1", "bn1", "relu1", "conv2", "bn2", "relu2", "conv3", "bn3")
        if stride != 1 or in_channels != out_channels:
            self.shortcut = Sequential(
                [
                    Conv2d(in_channels, out_channels, 1, stride, 0, bias=False, **kw),
                    BatchNorm2d(out_channels, dtype=dtype, xp=xp),
                ]
            )
        self._finish()

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.mid_channels}, stride={self.stride}, expansion={self.expansion}"
