"""The memory check under mpiexec (-n 2, -n 3): the ranks of a host are found by a shared-memory
split, their estimates summed against the host's limit, and every rank refuses alike."""

from __future__ import annotations

import os

import pytest

from hpcdl.comm import host_ranks, world
from hpcdl.config import load_config
from hpcdl.driver.factory import load_data
from hpcdl.driver.memory import Limits, check, estimate
from hpcdl.driver.run import plan
from hpcdl.errors import ConfigError

pytestmark = pytest.mark.mpi(min_size=2)


def test_the_ranks_of_this_host_are_every_rank_of_a_one_host_job() -> None:
    comm = world()
    assert host_ranks(comm) == list(range(comm.Get_size()))  # mpiexec without a host file: one host


def test_a_host_limit_one_rank_fits_but_all_do_not_is_refused_on_every_rank() -> None:
    comm = world()
    n = comm.Get_size()
    cfg = load_config("digits-cnn", ["data.batch_size=512", "data.sampler=random"])
    placement, data = plan(cfg, n), load_data(cfg)
    one = (estimate(cfg, placement, data) or [])[0].total()
    limit = Limits(host=int(1.5 * one), host_name="the test's limit ({})", group="", available=None,
                   address_space=None, rss=0, vm=0)  # fmt: skip
    with pytest.raises(ConfigError) as err:
        check(comm, cfg, placement, data, limits=limit)
    text = str(err.value)
    assert f"its {n} ranks need about" in text and "lower data.batch_size to at most" in text
    assert comm.allgather(text) == [text] * n  # the same line on every rank
    assert len(set(comm.allgather(os.getpid()))) == n
