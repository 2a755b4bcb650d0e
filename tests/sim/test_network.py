"""Max-min fair sharing of NIC bandwidth: exact contention arithmetic."""

from __future__ import annotations

import pytest

from kvcake.sim.network import Network

GB = 1e9


def test_single_flow_runs_at_line_rate() -> None:
    net = Network(2, 10 * GB)
    net.start_flow(0.0, 1, 0, 1, 20 * GB)
    assert net.flow(1).rate_bytes_per_s == 10 * GB
    assert net.next_finish_s() == pytest.approx(2.0)
    assert net.advance(1.999) == []
    assert net.advance(2.0) == [1]
    assert net.num_flows == 0 and net.next_finish_s() is None


def test_two_flows_out_of_one_node_share_its_egress() -> None:
    net = Network(3, 10 * GB)
    net.start_flow(0.0, 1, 0, 1, 10 * GB)
    net.start_flow(0.0, 2, 0, 2, 30 * GB)
    assert net.flow(1).rate_bytes_per_s == 5 * GB
    assert net.flow(2).rate_bytes_per_s == 5 * GB
    # Flow 1 ends at 2 s (10 GB at 5 GB/s); flow 2 has 20 GB left, then runs alone at 10 GB/s.
    assert net.next_finish_s() == pytest.approx(2.0)
    assert net.advance(2.0) == [1]
    assert net.flow(2).remaining_bytes == pytest.approx(20 * GB)
    assert net.flow(2).rate_bytes_per_s == 10 * GB
    assert net.next_finish_s() == pytest.approx(4.0)


def test_max_min_gives_the_unconstrained_flow_the_leftover() -> None:
    # Flows a: 0->2 and b: 1->2 share node 2's ingress (5 each); flow c: 1->3 shares node 1's
    # egress with b, so c gets 10 - 5 = 5... unless b is held to 5 by the ingress: c gets 5.
    # Add d: 0->3 to make node 0 egress shared by a and d, node 3 ingress by c and d.
    net = Network(4, 12 * GB)
    net.start_flow(0.0, 1, 0, 2, 100 * GB)  # a
    net.start_flow(0.0, 2, 1, 2, 100 * GB)  # b
    net.start_flow(0.0, 3, 1, 3, 100 * GB)  # c
    rates = {i: net.flow(i).rate_bytes_per_s / GB for i in (1, 2, 3)}
    # Every link has 2 flows at most: node 2 ingress (a, b) and node 1 egress (b, c) -> 6 each;
    # a is then alone on node 0 egress but held at 6 by node 2 ingress; c likewise by node 1.
    assert rates == pytest.approx({1: 6.0, 2: 6.0, 3: 6.0})
    net.advance(1.0)
    net.start_flow(1.0, 4, 2, 3, 100 * GB)  # d: node 3 ingress now has c and d
    rates = {i: net.flow(i).rate_bytes_per_s / GB for i in (1, 2, 3, 4)}
    assert rates == pytest.approx({1: 6.0, 2: 6.0, 3: 6.0, 4: 6.0})


def test_bottleneck_leftover_goes_to_less_constrained_flow() -> None:
    # Three flows into node 3 (ingress 12 -> 4 each), one more out of node 0 to node 1:
    # node 0 egress carries 0->3 (4) and 0->1, which gets the remaining 8.
    net = Network(4, 12 * GB)
    net.start_flow(0.0, 1, 0, 3, 50 * GB)
    net.start_flow(0.0, 2, 1, 3, 50 * GB)
    net.start_flow(0.0, 3, 2, 3, 50 * GB)
    net.start_flow(0.0, 4, 0, 1, 50 * GB)
    rates = [net.flow(i).rate_bytes_per_s / GB for i in (1, 2, 3, 4)]
    assert rates == pytest.approx([4.0, 4.0, 4.0, 8.0])
    assert net.total_bytes == 200 * GB


def test_bad_flows_are_refused_and_the_network_keeps_working() -> None:
    net = Network(2, GB)
    with pytest.raises(ValueError, match="src and dst"):
        net.start_flow(0.0, 1, 0, 0, GB)
    with pytest.raises(ValueError, match="dst node 5"):
        net.start_flow(0.0, 1, 0, 5, GB)
    with pytest.raises(ValueError, match="num_bytes"):
        net.start_flow(0.0, 1, 0, 1, 0)
    net.start_flow(0.0, 1, 0, 1, GB)
    with pytest.raises(ValueError, match="already running"):
        net.start_flow(0.0, 1, 1, 0, GB)
    assert net.advance(1.0) == [1]
    with pytest.raises(ValueError, match="NIC bandwidth"):
        Network(2, 0.0)
