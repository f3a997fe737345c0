"""Stochastic gradient descent with momentum, Nesterov momentum and weight decay."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hpcdl.backend import get_array_module
from hpcdl.nn.parameter import Parameter
from hpcdl.optim.optimizer import Optimizer

try:
    from hpcdl._ext import fused as _fused
except ImportError:  # not built: the array-module path below does the same, in more passes
    _fused = None

__all__ = ["SGD"]


class SGD(Optimizer):
    """SGD as PyTorch defines it (dampening 0)::

        g = grad + weight_decay * w
        v = momentum * v + g                     (v = g at the first step)
        w -= lr * (g + momentum * v)  if nesterov else  lr * v

    Updates are in place through one scratch buffer shared by all parameters,
    so a step allocates nothing and ``p.grad`` keeps the exchanged gradient. NumPy
    parameters of float32 or float64 are updated by one compiled pass each
    (``hpcdl._ext.fused.sgd``), which gives the same bits as the array-module path.
    """

    _state_names = ("momentum_buffer",)

    def __init__(
        self,
        params: Sequence[Parameter],
        lr: float,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
    ) -> None:
        if nesterov and momentum <= 0:
            raise ValueError(f"Nesterov momentum needs momentum > 0 (got {momentum})")
        if momentum == 0:
            self._state_names = ()
        super().__init__(params, lr)
        self.momentum = float(momentum)
        self.nesterov = nesterov
        self.weight_decay = float(weight_decay)
        self._scratch = self._scratch_buffer()

    def step(self) -> None:
        lr, mu, wd = self.lr, self.momentum, self.weight_decay
        bufs = self.state.get("momentum_buffer")
        first = self.t == 0
        # a NumPy scalar lr (set from outside) would make NumPy compute in its precision
        kernel = _fused if type(lr) is float else None
        for i, p in enumerate(self.params):
            v = None if bufs is None else bufs[i]
            if kernel is None or not kernel.sgd(p.data, p.grad, v, lr, mu, wd, first, self.nesterov):
                self._update(p.data, p.grad, v, first)
        self.t += 1

    def _update(self, w: Any, g: Any, v: Any, first: bool) -> None:
        """One parameter's update with array-module operations (``v``: None without momentum)."""
        lr, mu, wd = self.lr, self.momentum, self.weight_decay
        xp = get_array_module(w)
        tmp = self._scratch[: w.size].reshape(w.shape)
        if wd:
            xp.multiply(w, wd, out=tmp)
            tmp += g
            g = tmp  # g + wd * w
        if v is not None:
            if first:
                v[...] = g
            else:
                v *= mu
                v += g
            if self.nesterov:
                if g is not tmp:
                    tmp[...] = g
                tmp += mu * v
                g = tmp  # g + mu * v
            else:
                g = v
        xp.multiply(g, lr, out=tmp)
        w -= tmp
