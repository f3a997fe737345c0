"""Class labels: integers in ``0 .. C - 1``, with the class count C given by the config or inferred."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from hpcdl.errors import DataError

__all__ = ["class_count"]


def _num(v: object) -> str:
    return f"{v:g}" if isinstance(v, float | np.floating) else str(v)


def _found(y: np.ndarray) -> str:
    """``lo..hi`` of a label array of any numeric dtype."""
    return f"{_num(y.min().item())}..{_num(y.max().item())}"


def _gaps(present: np.ndarray, limit: int = 4) -> str:
    """The values of ``0 .. present[-1]`` missing from the sorted unique ``present``, as runs."""
    starts = np.concatenate(([-1], present))
    d = np.diff(starts)
    runs = [(int(starts[i]) + 1, int(starts[i + 1]) - 1) for i in np.nonzero(d > 1)[0][: limit + 1]]
    text = ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs[:limit])
    return text + (", ..." if len(runs) > limit else "")


def class_count(
    ys: Mapping[str, np.ndarray],
    source: str | os.PathLike[str],
    num_classes: int = 0,
    *,
    own: int | None = None,
) -> int:
    """Check a data set's labels and return its class count.

    Labels must be integers in ``0 .. C - 1``. The count ``C`` is ``num_classes`` when it
    is given (``data.num_classes``); with 0 it is the data set's own: ``own`` for data sets
    with a fixed count (MNIST, CIFAR-10, the digits: 10), else inferred as the largest
    label plus one, trusted only when every class ``0 .. C - 1`` occurs in the labels (so
    labels 5..14, or 1-based labels, are reported instead of silently adding classes).
    A data set with a fixed count accepts only that count.

    Args:
        ys: The label arrays by the name errors should give them (``{"y_train": ...,
            "y_test": ...}``, or the label files' names).
        source: The file or directory the labels come from, named in errors.
        num_classes: The class count asked for; 0: the data set's own.
        own: The data set's fixed class count, or None to infer it from the labels.

    Returns:
        The class count, at least 2.

    Raises:
        DataError: labels are not integers, are negative, are not below the class count,
            or the count cannot be inferred (no labels, a single class, classes that never
            occur), or a fixed-count data set is asked for another count. The message names
            ``source``, the array, the range of labels found and the range expected.
    """
    if num_classes < 0 or num_classes == 1:
        raise DataError(
            f"the class count must be at least 2, or 0 for the data set's own (got {num_classes})"
        )
    count = own if num_classes == 0 else num_classes
    why = f"data.num_classes = {num_classes}" if num_classes else f"the data set has {own} classes"
    expected = f"0..{count - 1}" if count else "from 0"
    for name, y in ys.items():
        if not np.issubdtype(y.dtype, np.integer):
            values = f" (values {_found(y)})" if y.dtype.kind in "bf" and y.size else ""
            raise DataError(
                f"{source}: {name} holds {y.dtype} labels{values}, expected integer class labels "
                f"{expected}: store the labels as integers (e.g. y.astype(np.int64))"
            )
        if not y.size:
            continue
        lo, hi = int(y.min()), int(y.max())
        if lo < 0:
            given = f" ({why})" if count else ""
            raise DataError(
                f"{source}: {name} has labels {lo}..{hi}, expected {expected}{given}: class numbers "
                f"count from 0; relabel the data"
            )
        if count and hi >= count:
            if own is not None and num_classes in (0, own):
                fix = "is it the right file?"
            else:
                infer = ", or 0 to infer it from the labels" if lo == 0 else ", or relabel the data from 0"
                fix = f"set data.num_classes = {hi + 1}{infer}"
            raise DataError(f"{source}: {name} has labels {lo}..{hi}, expected 0..{count - 1} ({why}): {fix}")
    if own is not None and num_classes not in (0, own):
        found = ", ".join(f"{name} {_found(y)}" for name, y in ys.items() if y.size)
        raise DataError(
            f"{source}: the data set has {own} classes (labels {found}), but data.num_classes = "
            f"{num_classes}: set data.num_classes = {own}, or 0 for the data set's own count"
        )
    if count:
        return count
    present = np.unique(np.concatenate([y.ravel() for y in ys.values()]))  # sorted
    if not present.size:
        raise DataError(f"{source}: no labels to infer the class count from: set data.num_classes")
    inferred = int(present[-1]) + 1
    if inferred < 2:
        raise DataError(
            f"{source}: every label is 0, a single class; a classifier needs at least 2 (expected "
            f"labels 0..C-1 with C >= 2): check the labels"
        )
    if present.size < inferred:
        raise DataError(
            f"{source}: labels run {int(present[0])}..{inferred - 1}, so the inferred class count "
            f"would be {inferred}, but class(es) {_gaps(present)} never occur (expected every class "
            f"in 0..{inferred - 1}): relabel the data, or set data.num_classes = {inferred} to keep "
            f"these labels"
        )
    return inferred
