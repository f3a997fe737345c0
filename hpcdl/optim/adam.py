"""Adam and AdamW (decoupled weight decay)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from hpcdl.backend import get_array_module
from hpcdl.nn.parameter import Parameter
from hpcdl.optim.optimizer import Optimizer

__all__ = ["Adam", "AdamW"]


class Adam(Optimizer):
    """Adam (Kingma & Ba) with bias correction, as PyTorch defines it::

        g = grad + weight_decay * w              (Adam: L2 in the gradient)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g^2
        w -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

    ``decoupled=True`` (AdamW) instead applies ``w -= lr * weight_decay * w``
    before the update and leaves the gradient alone.
    """

    _state_names = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Sequence[Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled: bool = False,
    ) -> None:
        super().__init__(params, lr)
        self.beta1, self.beta2 = (float(b) for b in betas)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.decoupled = decoupled
        self._scratch = self._scratch_buffer()

    def step(self) -> None:
        self.t += 1
        b1, b2, lr, wd = self.beta1, self.beta2, self.lr, self.weight_decay
        bc1 = 1.0 - b1**self.t
        bc2 = 1.0 - b2**self.t
        step_size = lr / bc1
        for p, m, v in zip(self.params, self.state["exp_avg"], self.state["exp_avg_sq"]):
            w, g = p.data, p.grad
            xp = get_array_module(w)
            tmp = self._scratch[: w.size].reshape(w.shape)
            if wd and self.decoupled:
                w *= 1.0 - lr * wd
            elif wd:
                xp.multiply(w, wd, out=tmp)
                tmp += g
                g = tmp
            m *= b1
            m += (1.0 - b1) * g
            v *= b2
            xp.multiply(g, g, out=tmp)
            tmp *= 1.0 - b2
            v += tmp
            xp.sqrt(v, out=tmp)
            tmp *= 1.0 / math.sqrt(bc2)
            tmp += self.eps
            xp.divide(m, tmp, out=tmp)
            tmp *= step_size
            w -= tmp


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter)."""

    def __init__(
        self,
        params: Sequence[Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, decoupled=True)
