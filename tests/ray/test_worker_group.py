"""WorkerGroup's calls: a worker's error reaches the driver as one line naming the rank, also
when Ray cannot rebuild the error's class on the driver."""

from __future__ import annotations

import pytest

from launch.cluster import WorkerGroup
from launch.recovery import WorkerCallError


class UnpicklableError(Exception):
    """An error whose __init__ takes two arguments: pickling it by its args cannot rebuild it."""

    def __init__(self, what: str, where: str) -> None:
        super().__init__(f"{where}: {what} is wrong")


class Raiser:
    def plain(self) -> None:
        raise ValueError("bad value\nsecond line")

    def odd(self) -> None:
        raise UnpicklableError("the widget", "/some/file")


@pytest.fixture(scope="module")
def group(ray_local):
    g = WorkerGroup(Raiser, 1, lambda rank, num_nodes: ((), {}), call_timeout_s=60)
    yield g
    g.shutdown()


def test_a_workers_error_names_the_rank_and_keeps_the_cause(group):
    with pytest.raises(WorkerCallError, match=r"^worker rank 0 on node 0 \(\w+\) failed in plain: bad value$") as info:
        group.call("plain")
    assert isinstance(info.value.cause, ValueError) and info.value.rank == 0


def test_an_error_ray_cannot_rebuild_still_names_the_rank_and_the_problem(group):
    with pytest.raises(WorkerCallError, match=r"^worker rank 0 on node 0 \(\w+\) failed in odd: "
                                              r".*UnpicklableError: /some/file: the widget is wrong$") as info:
        group.call("odd")
    assert info.value.cause is None and info.value.rank == 0
