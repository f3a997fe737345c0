"""``Optimizer``: the base class (parameters, learning rate, state for checkpoints)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hpcdl.backend import get_array_module, to_numpy
from hpcdl.nn.parameter import Parameter

__all__ = ["Optimizer"]


class Optimizer:
    """Updates parameters from their ``.grad``; ``lr`` may be changed between steps.

    Subclasses keep per-parameter state arrays in ``self.state[name]`` (a list
    aligned with ``self.params``) so that :meth:`state_dict` captures them all.
    """

    #: names of the per-parameter state arrays (``self.state[name][i]``)
    _state_names: tuple[str, ...] = ()

    def __init__(self, params: Sequence[Parameter], lr: float) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        self.lr = float(lr)
        self.t = 0  # steps taken
        self.state: dict[str, list[Any]] = {
            name: [get_array_module(p.data).zeros_like(p.data) for p in self.params]
            for name in self._state_names
        }

    def step(self) -> None:
        """Apply one update to every parameter."""
        raise NotImplementedError

    def _scratch_buffer(self) -> Any:
        """A flat buffer as large as the largest parameter, for in-place updates."""
        big = max(self.params, key=lambda p: p.size).data
        return get_array_module(big).empty(big.size, dtype=big.dtype)

    def state_dict(self) -> dict[str, Any]:
        """Step count, lr and per-parameter state as NumPy copies keyed ``<state>/<index>``.

        ``param_names`` lists the parameters' names in order, so that a loader
        can tell a state saved for another model.
        """
        out: dict[str, Any] = {"t": self.t, "lr": self.lr, "param_names": [p.name for p in self.params]}
        for name, arrays in self.state.items():
            for i, a in enumerate(arrays):
                out[f"{name}/{i}"] = to_numpy(a).copy()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (same parameters, same order).

        Raises:
            ValueError: the state was saved for other parameters.
        """
        names = [p.name for p in self.params]
        if list(state["param_names"]) != names:
            raise ValueError(
                f"optimizer state is for parameters {list(state['param_names'])[:4]}..., not {names[:4]}..."
            )
        self.t = int(state["t"])
        self.lr = float(state["lr"])
        for name, arrays in self.state.items():
            for i, a in enumerate(arrays):
                src = np.asarray(state[f"{name}/{i}"])
                if src.shape != tuple(a.shape):
                    raise ValueError(
                        f"optimizer state {name}/{i} has shape {src.shape}, expected {tuple(a.shape)}"
                    )
                a[...] = get_array_module(a).asarray(src, dtype=a.dtype)
