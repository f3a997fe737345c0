"""Data sets, distributed samplers and batching.

Readers return a `Dataset` (read-only NumPy arrays, images N,C,H,W float32);
`load_dataset` picks one by name and caches it per process, so simulated ranks share
one copy. `DistributedSampler` says which samples each rank takes at each step, and
`gather_batch` fetches them onto the device.
"""

from __future__ import annotations

from hpcdl.data.arrays import load_hdf5, load_npz
from hpcdl.data.batch import gather_batch
from hpcdl.data.cifar import load_cifar10
from hpcdl.data.dataset import Dataset
from hpcdl.data.digits import find_digits, load_digits
from hpcdl.data.idx import load_mnist, read_idx
from hpcdl.data.load import DATASETS, clear_cache, load_dataset
from hpcdl.data.sampler import KINDS, DistributedSampler
from hpcdl.data.synthetic import synthetic

__all__ = [
    "DATASETS",
    "KINDS",
    "Dataset",
    "DistributedSampler",
    "clear_cache",
    "find_digits",
    "gather_batch",
    "load_cifar10",
    "load_dataset",
    "load_digits",
    "load_hdf5",
    "load_mnist",
    "load_npz",
    "read_idx",
    "synthetic",
]
