"""``store_calls.call`` remembers a store found gone, and only that store: a later group's store,
even one that gets the same ``id`` once the old one is dropped, is asked normally. (An engine joins
a new trainer's group after the old trainer's store vanished; remembering by id refused the new
group's store as "found before" whenever CPython reused the address.)"""

from __future__ import annotations

import datetime
import gc

import pytest
import torch.distributed as dist

from reshard_core.coordination.store_calls import StoreHost, StoreSilent, call
from reshard_core.testing.world import free_port

HOST = StoreHost("rank 0", "close the transfer group and join a new one")


def _pair() -> tuple[dist.TCPStore, dist.TCPStore]:
    port = free_port()
    timeout = datetime.timedelta(seconds=5)
    host = dist.TCPStore("127.0.0.1", port, None, True, timeout=timeout, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
    return host, client


def test_a_store_whose_host_exited_is_named_then_refused_at_once() -> None:
    host, client = _pair()
    assert call(client, lambda s: s.add("k", 1), 2.0, HOST) == 1
    del host
    gc.collect()
    with pytest.raises(StoreSilent) as first:
        call(client, lambda s: s.add("k", 1), 2.0, HOST)
    assert str(first.value).startswith("the group's store (hosted by rank 0) is gone (")
    assert str(first.value).endswith("): rank 0 exited or its connection broke")
    with pytest.raises(StoreSilent) as again:
        call(client, lambda s: s.add("k", 1), 2.0, HOST)
    assert str(again.value).endswith(
        "(found before); this group cannot refit again: close the transfer group and join a new one"
    )


class _Store:
    """A store stand-in: one whose host exited (``gone``) raises the network error a TCPStore raises."""

    def __init__(self, gone: bool) -> None:
        self.gone = gone

    def add(self, key: str, n: int) -> int:
        if self.gone:
            raise dist.DistNetworkError("Broken pipe")
        return n


def _found_gone() -> int:
    """The address of a store that ``call`` found gone and that is dropped since."""
    gone = _Store(gone=True)
    try:
        call(gone, lambda s: s.add("k", 1), 1.0, HOST)
    except StoreSilent as exc:
        assert "is gone (Broken pipe)" in str(exc)
        del exc
    else:
        raise AssertionError("a gone store answered")
    return id(gone)


def test_a_new_store_at_a_gone_stores_address_is_asked_normally() -> None:
    addresses = {_found_gone() for _ in range(20)}
    gc.collect()
    fresh = [_Store(gone=False) for _ in range(2000)]  # some get a freed address
    reused = [store for store in fresh if id(store) in addresses]
    assert reused, "the case this test is about never happened: no address was reused"
    assert [call(store, lambda s: s.add("k", 7), 1.0, HOST) for store in reused] == [7] * len(reused)
