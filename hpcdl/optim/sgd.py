"""Stochastic gradient descent with momentum, Nesterov momentum and weight decay."""

from __future__ import annotations

from collections.abc import Sequence

from hpcdl.backend import get_array_module
from hpcdl.nn.parameter import Parameter
from hpcdl.optim.optimizer import Optimizer

__all__ = ["SGD"]


class SGD(Optimizer):
    """SGD as PyTorch defines it (dampening 0)::

        g = grad + weight_decay * w
        v = momentum * v + g                     (v = g at the first step)
        w -= lr * (g + momentum * v)  if nesterov else  lr * v

    Updates are in place through one scratch buffer shared by all parameters,
    so a step allocates nothing and ``p.grad`` keeps the exchanged gradient.
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
        for i, p in enumerate(self.params):
            w, g = p.data, p.grad
            xp = get_array_module(w)
            tmp = self._scratch[: w.size].reshape(w.shape)
            if wd:
                xp.multiply(w, wd, out=tmp)
                tmp += g
                g = tmp  # g + wd * w
            if bufs is not None:
                v = bufs[i]
                if self.t == 0:
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
        self.t += 1
