"""Cluster membership and leadership in etcd (never bulk data; DESIGN.md section 8).

- `etcd.py`: `Etcd`, the few etcd operations kvcake uses, over etcd's JSON gateway (etcd3gw).
- `lease.py`: `KeptLease`, a lease kept alive by a thread, with a callback when it is lost.
- `members.py`: `Member` (role, advertised address, model and layout fingerprint), `register`
  under a kept lease, and `MemberWatch`, which reports members as they come and go.
- `election.py`: `Election`, leadership as a key created in a transaction under the leader's lease.
- `process.py`: `EtcdProcess`, a real `etcd` on free ports in a temporary directory (tests, benchmarks).
"""

from kvcake.registry.election import Election
from kvcake.registry.etcd import Etcd, EtcdUnavailable, parse_endpoints
from kvcake.registry.lease import KeptLease
from kvcake.registry.members import Member, MemberWatch, Registration, members_prefix

__all__ = ["Election", "Etcd", "EtcdUnavailable", "KeptLease", "Member", "MemberWatch",
           "Registration", "members_prefix", "parse_endpoints"]
