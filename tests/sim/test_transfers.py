from types import SimpleNamespace
from typing import Any

from kvcake.conductor import FetchPlan
from kvcake.sim.guard import DecodeNodeGuard
from kvcake.sim.network import Network
from kvcake.sim.transfers import Transfer, TransferKind, Transfers, fetch_tokens_by_node


def test_fetch_tokens_by_node_splits_partial_first_and_last_blocks() -> None:
    # tokens 2..10 over 4-token blocks 0, 1, 2: 2 + 4 + 2 tokens
    fetch = FetchPlan("prefill-0", ("a", "b", "c"), start_len=2, end_len=10, num_bytes=0,
                      transfer_s=0.0)
    holders = {"a": 1, "b": 2, "c": 1}
    assert fetch_tokens_by_node(fetch, 4, holders.__getitem__) == {1: 4, 2: 4}


def test_transfers_report_what_landed_and_recognise_a_stale_event() -> None:
    transfers = Transfers(Network(2, 100.0))
    transfers.start(0.0, Transfer(TransferKind.FETCH, 7), 0, 1, 100.0)
    (first,) = transfers.next_event()
    transfers.start(0.0, Transfer(TransferKind.KV, 8, epoch=2), 1, 0, 300.0)
    assert transfers.stale(first)  # the flows changed: the first event no longer holds
    (event,) = transfers.next_event()
    assert event.time_s == 1.0 and not transfers.stale(event)
    assert transfers.landed(event.time_s) == [Transfer(TransferKind.FETCH, 7)]
    (last,) = transfers.next_event()
    assert last.time_s == 3.0
    assert transfers.landed(last.time_s) == [Transfer(TransferKind.KV, 8, 2)]
    assert transfers.next_event() == []


def test_decode_node_guard_keeps_the_choice_moves_or_refuses() -> None:
    decodes: list[Any] = [SimpleNamespace(kv_tokens=60), SimpleNamespace(kv_tokens=0)]
    guard = DecodeNodeGuard(2, kv_capacity_tokens=100)
    assert guard.place(0, 40, 0, decodes) == 0  # 100 - 60 = 40 left on the chosen node
    assert guard.place(1, 30, 0, decodes) == 1  # node 0 is full with request 0 committed
    assert guard.place(2, 80, 1, decodes) is None  # node 1: 100 - 30 = 70 < 80
    guard.release(1)
    assert guard.place(2, 80, 0, decodes) == 1  # request 1 released: node 1 free again
