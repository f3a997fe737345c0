"""``Layer``: the base class of every layer (explicit forward and backward)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from hpcdl.backend import get_array_module, to_numpy
from hpcdl.nn.parameter import Parameter

__all__ = ["Layer"]


class Layer:
    """A layer with explicit ``forward(x) -> y`` and ``backward(gy) -> gx``.

    ``forward`` keeps what ``backward`` needs (the cache) on the layer; ``backward``
    writes the gradient of each parameter into ``Parameter.grad`` (overwriting it)
    and returns the gradient with respect to the input. Subclasses list their
    parameters in ``_params`` (attribute names, in a fixed order), their
    non-trainable state such as BatchNorm's running statistics in ``_buffers``,
    and any child layers in ``_children``.

    **One call's state.** ``forward`` keeps its cache in the attributes the class lists
    in ``_cache``. A pipeline stage runs several microbatches forward before their
    backwards: it takes each forward's cache with :meth:`save_cache` and puts it back
    with :meth:`load_cache` before that microbatch's backward (a handle per microbatch).
    The one-batch path, forward then backward, needs neither.

    ``needs_input_grad`` (default ``True``): when a model builder sets it to
    ``False`` (on the first layer of a model, whose input is data), a layer may
    skip computing the input gradient and return ``None`` from ``backward``;
    layers without parameters pass a ``None`` gradient through as ``None``.
    """

    _params: tuple[str, ...] = ()
    _buffers: tuple[str, ...] = ()
    _children: tuple[str, ...] = ()
    #: the attributes ``forward`` sets for ``backward`` (one call's cache)
    _cache: tuple[str, ...] = ()
    needs_input_grad: bool = True

    def __init__(self) -> None:
        self.name = ""
        self.training = True

    # -- computation -------------------------------------------------------
    def forward(self, x: Any) -> Any:
        raise NotImplementedError

    def backward(self, gy: Any) -> Any:
        raise NotImplementedError

    def __call__(self, x: Any) -> Any:
        return self.forward(x)

    # -- one call's state -------------------------------------------------------
    def save_cache(self) -> dict[str, Any]:
        """The last forward's cache here and in every child (references: the next forward
        replaces the attributes, it does not write into the arrays)."""
        state: dict[str, Any] = {attr: getattr(self, attr) for attr in self._cache}
        for child_attr, child in zip(self._children, self.children(), strict=True):
            state[child_attr + "."] = child.save_cache()
        return state

    def load_cache(self, state: dict[str, Any]) -> None:
        """Put back what :meth:`save_cache` returned, so that ``backward`` is that forward's."""
        for attr in self._cache:
            setattr(self, attr, state[attr])
        for child_attr, child in zip(self._children, self.children(), strict=True):
            child.load_cache(state[child_attr + "."])

    # -- structure ----------------------------------------------------------
    def children(self) -> list[Layer]:
        """Direct child layers, in definition order."""
        return [getattr(self, c) for c in self._children]

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """``(dotted name, Parameter)`` pairs in the fixed definition order."""
        for attr in self._params:
            p = getattr(self, attr)
            if p is not None:
                yield prefix + attr, p
        for child_attr, child in zip(self._children, self.children(), strict=True):
            yield from child.named_parameters(f"{prefix}{child_attr}.")

    def parameters(self) -> list[Parameter]:
        """All trainable parameters, in the fixed definition order."""
        return [p for _, p in self.named_parameters()]

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        """``(dotted name, array)`` pairs of non-trainable state."""
        for attr in self._buffers:
            yield prefix + attr, getattr(self, attr)
        for child_attr, child in zip(self._children, self.children(), strict=True):
            yield from child.named_buffers(f"{prefix}{child_attr}.")

    def assign_names(self, prefix: str = "") -> None:
        """Give this layer, its children and its parameters their dotted names."""
        self.name = prefix.rstrip(".") or type(self).__name__
        for attr in self._params:
            p = getattr(self, attr)
            if p is not None:
                p.name = prefix + attr
        for child_attr, child in zip(self._children, self.children(), strict=True):
            child.assign_names(f"{prefix}{child_attr}.")

    # -- modes --------------------------------------------------------------
    def train(self, mode: bool = True) -> Layer:
        """Set training mode (``False``: evaluation) here and in every child."""
        self.training = mode
        for child in self.children():
            child.train(mode)
        return self

    def eval(self) -> Layer:
        """Set evaluation mode (BatchNorm uses running statistics, Dropout is off)."""
        return self.train(False)

    def zero_grad(self) -> None:
        """Set every parameter's gradient to zero."""
        for p in self.parameters():
            p.grad[...] = 0

    # -- state --------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters and buffers by dotted name, as NumPy copies (host memory)."""
        state = {n: to_numpy(p.data).copy() for n, p in self.named_parameters()}
        state.update({n: to_numpy(b).copy() for n, b in self.named_buffers()})
        return state

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Copy arrays from ``state`` into this layer's parameters and buffers.

        Raises:
            KeyError: ``strict`` and names are missing or unexpected.
            ValueError: a shape differs.
        """
        targets: dict[str, Any] = {n: p.data for n, p in self.named_parameters()}
        targets.update(dict(self.named_buffers()))
        if strict:
            missing = sorted(set(targets) - set(state))
            unexpected = sorted(set(state) - set(targets))
            if missing or unexpected:
                raise KeyError(f"state_dict mismatch: missing {missing}, unexpected {unexpected}")
        for name, dst in targets.items():
            if name not in state:
                continue
            src = np.asarray(state[name])
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"{name}: shape {tuple(src.shape)} does not match {tuple(dst.shape)}")
            xp = get_array_module(dst)
            dst[...] = xp.asarray(src, dtype=dst.dtype)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"
