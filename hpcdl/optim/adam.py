"""Adam and AdamW (decoupled weight decay)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from hpcdl.backend import get_array_module
from hpcdl.nn.parameter import Parameter
from hpcdl.optim.optimizer import Optimizer

try:
    from hpcdl._ext import fused as _fused
except ImportError:  # not built: the array-module path below does the same, in more passes
    _fused = None

__all__ = ["Adam", "AdamW"]


class Adam(Optimizer):
    """Adam (Kingma & Ba) with bias correction, as PyTorch defines it::

        g = grad + weight_decay * w              (Adam: L2 in the gradient)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g^2
        w -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

    ``decoupled=True`` (AdamW) instead applies ``w -= lr * weight_decay * w``
    before the update and leaves the gradient alone. NumPy parameters of float32 or
    float64 are updated by one compiled pass each (``hpcdl._ext.fused.adam``), which
    gives the same bits as the array-module path.
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
        inv_sqrt_bc2 = 1.0 / math.sqrt(bc2)
        mode = 0 if not wd else 1 if self.decoupled else 2  # fused.ADAM_PLAIN, _DECOUPLED, _L2
        # a NumPy scalar lr (set from outside) would make NumPy compute in its precision
        kernel = _fused if type(lr) is float else None
        for p, m, v in zip(self.params, self.state["exp_avg"], self.state["exp_avg_sq"]):
            if kernel is None or not kernel.adam(
                p.data, p.grad, m, v, mode, 1.0 - lr * wd, wd, b1, 1.0 - b1, b2, 1.0 - b2,
                inv_sqrt_bc2, self.eps, step_size,
            ):  # fmt: skip
                self._update(p.data, p.grad, m, v, step_size, inv_sqrt_bc2)

    def _update(self, w: Any, g: Any, m: Any, v: Any, step_size: float, inv_sqrt_bc2: float) -> None:
        """One parameter's update with array-module operations."""
        b1, b2, lr, wd = self.beta1, self.beta2, self.lr, self.weight_decay
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
        tmp *= inv_sqrt_bc2
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
