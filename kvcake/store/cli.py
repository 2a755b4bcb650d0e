"""`kvcake store master --port P [--with-node 4GiB | --no-node]` and `kvcake store node --master
HOST:P --dram 4GiB [--disk DIR --disk-size 20GiB]`. Both log, report stats every
`--stats-interval-s`, and stop cleanly on SIGTERM or SIGINT: a node unregisters first, so the
master drops only that node's replicas.

Deployments. By default `kvcake store master` hosts a store node of `DEFAULT_HOSTED_DRAM` in its
own process (store/hosted.py), as `redis-server` holds its data: one command gives a working
store, and a small put is one request to it. Dedicated `kvcake store node` processes join it to
pool more DRAM and SSD. `--no-node` runs a metadata-only master, as Mooncake's `mooncake_master`
runs: the data then lives only in the nodes that join. A master elected through `--etcd` hosts
no node (a standby's node would hold nothing; its nodes register in etcd)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from kvcake.store.config import MasterConfig, NodeConfig, Strategy
from kvcake.store.errors import MasterUnavailable
from kvcake.units import parse_size

log = logging.getLogger("kvcake.store")
_MASTER = MasterConfig()
DEFAULT_HOSTED_DRAM = "1GiB"  # the node a master hosts unless told otherwise (module docstring)


def register(subparsers: Any) -> None:
    store = subparsers.add_parser("store", help="run a Mooncake Store master or node")
    sub = store.add_subparsers(dest="store_command", metavar="ROLE")
    sub.required = True
    _master_parser(sub)
    _node_parser(sub)


def _master_parser(sub: Any) -> None:
    master = sub.add_parser("master", help="the master (metadata; hosts a store node "
                            "unless --no-node)")
    master.add_argument("--host", default="127.0.0.1", help="address the RPC port binds")
    master.add_argument("--port", type=int, required=True, help="0 picks a free port")
    _etcd_flags(master, "elect one master among those started with the same etcd and "
                "--cluster (the others stand by and take over when it dies)")
    master.add_argument("--recovery-s", type=float, default=10.0,
                        help="after a takeover, how long client requests wait for the store "
                        "nodes registered in etcd to re-register their objects")
    master.add_argument("--high-watermark", type=float, default=_MASTER.high_watermark)
    master.add_argument("--low-watermark", type=float, default=_MASTER.low_watermark)
    master.add_argument("--lease-s", type=float, default=_MASTER.lease_s)
    master.add_argument("--put-timeout-s", type=float, default=_MASTER.put_timeout_s)
    master.add_argument("--heartbeat-timeout-s", type=float, default=_MASTER.heartbeat_timeout_s)
    master.add_argument("--replicas", type=int, default=_MASTER.default_replicas)
    master.add_argument("--strategy", choices=[s.value for s in Strategy],
                        default=_MASTER.strategy.value)
    master.add_argument("--stats-interval-s", type=float, default=30.0)
    master.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus /metrics on this port of --host (0: any port)")
    master.add_argument("--with-node", default=None, metavar="DRAM",
                        help="the DRAM segment of the store node this master hosts in its "
                        f"process (default {DEFAULT_HOSTED_DRAM}; not with --etcd): a single put "
                        "placed on it is one client round trip (store/hosted.py); other nodes "
                        "join as usual")
    master.add_argument("--no-node", action="store_true",
                        help="a metadata-only master (as mooncake_master): it hosts no node, the "
                        "data lives in the `kvcake store node` processes that join")
    master.add_argument("--node-id", default=None, help="the hosted node's id")
    master.add_argument("--node-port", type=int, default=0,
                        help="the hosted node's segment server port (0: any)")
    master.add_argument("--node-rails", type=int, default=4,
                        help="the hosted node's transfer connections per peer")
    master.add_argument("--no-prefault", dest="prefault", action="store_false",
                        help="the hosted node does not make its segment resident at start "
                             "(see node --no-prefault)")
    _secret_flags(master)
    master.set_defaults(func=run_master)


def _node_parser(sub: Any) -> None:
    node = sub.add_parser("node", help="a node contributing DRAM (and disk) to the pool")
    node.add_argument("--master", default=None, help="HOST:PORT of the master (or "
                      "etcd://HOST:PORT[/CLUSTER]; see --etcd)")
    _etcd_flags(node, "register in etcd and follow the elected master (instead of --master)")
    node.add_argument("--dram", required=True, help="segment size, e.g. 4GiB")
    node.add_argument("--disk", default=None, help="directory of the SSD tier")
    node.add_argument("--disk-size", default="0", help="SSD tier size, e.g. 20GiB")
    node.add_argument("--node-id", default=None)
    node.add_argument("--host", default="127.0.0.1", help="address the segment server binds")
    node.add_argument("--port", type=int, default=0, help="segment server port (0: any)")
    node.add_argument("--rails", type=int, default=4, help="transfer connections per peer")
    node.add_argument("--heartbeat-interval-s", type=float, default=1.0)
    node.add_argument("--stats-interval-s", type=float, default=30.0)
    node.add_argument("--no-prefault", dest="prefault", action="store_false",
                      help="do not make the segment's pages resident at start (default: they "
                           "are, so no put pays first-touch page faults; off, the memory is taken "
                           "as objects first land in it)")
    _secret_flags(node)
    node.set_defaults(func=run_node)


def _etcd_flags(parser: Any, what: str) -> None:
    parser.add_argument("--etcd", default=None, metavar="HOST:PORT[,HOST:PORT]", help=what)
    parser.add_argument("--cluster", default="kvcake", help="name of the cluster in etcd")
    parser.add_argument("--advertise-host", default=None,
                        help="address peers dial for this process (default: --host)")


def _advertised(args: argparse.Namespace) -> str:
    host = args.advertise_host or args.host
    if host in ("0.0.0.0", "::", ""):
        raise ValueError(f"--advertise-host: binding {args.host!r} listens everywhere; give the "
                         "address peers should dial")
    return str(host)


def _secret_flags(parser: Any) -> None:
    parser.add_argument("--secret-file", default=None, help="file holding the cluster secret "
                        "(mode 600); every connection must then prove it (kvcake/auth.py)")
    parser.add_argument("--secret-env", default=None, metavar="NAME",
                        help="environment variable holding the cluster secret (instead of a file)")


def _secret(args: argparse.Namespace) -> Any:
    from kvcake.auth import ClusterSecret

    try:
        return ClusterSecret.load(file=args.secret_file, env=args.secret_env)
    except ValueError as exc:
        raise ValueError(f"--secret-file/--secret-env: {exc}") from None


def _serve_until_signal(report: Callable[[], dict[str, Any]], interval_s: float,
                        stop: threading.Event) -> None:
    """Log `report()` every `interval_s` until `stop` (set by SIGTERM / SIGINT) is set."""
    while not stop.wait(interval_s):
        log.info("stats %s", json.dumps(report(), sort_keys=True))


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def run_master(args: argparse.Namespace) -> int:
    from kvcake.store.master import MasterService
    from kvcake.store.master_server import MasterServer

    config = MasterConfig(high_watermark=args.high_watermark, low_watermark=args.low_watermark,
                          lease_s=args.lease_s, put_timeout_s=args.put_timeout_s,
                          heartbeat_timeout_s=args.heartbeat_timeout_s,
                          default_replicas=args.replicas, strategy=Strategy(args.strategy))
    hosted_dram = hosted_node_dram(args)
    _logging()
    stop = _stop_on_signal()  # before starting: a SIGTERM during the start stops it cleanly
    if args.etcd:
        return _run_elected_master(args, config, stop)
    if hosted_dram is not None:
        return _run_hosting_master(args, config, hosted_dram, stop)
    server = MasterServer(MasterService(config), args.host, args.port, secret=_secret(args))
    server.start()
    log.info("master listening on %s", server.address)
    return _serve_then_close(args, server.service.stats, server.close, "master stopped", stop)


def hosted_node_dram(args: argparse.Namespace) -> int | None:
    """The DRAM bytes of the node `kvcake store master` hosts (module docstring), None for a
    metadata-only master (`--no-node`, or elected through `--etcd`)."""
    if args.no_node and args.with_node:
        raise ValueError("--with-node/--no-node: give one (a hosted node of that size, or none)")
    if args.etcd and args.with_node:
        raise ValueError("--with-node: not with --etcd (an elected master hosts no node); start "
                         "`kvcake store node` processes instead")
    if args.no_node or args.etcd:
        return None
    return parse_size(args.with_node or DEFAULT_HOSTED_DRAM, "--with-node")


def _run_hosting_master(args: argparse.Namespace, config: MasterConfig, dram_bytes: int,
                        stop: threading.Event) -> int:
    """A master with a node in its process (store/hosted.py) until SIGTERM / SIGINT."""
    from kvcake.store.hosted import HostedConfig, HostedStore
    from kvcake.transfer import TransferConfig

    secret = _secret(args)
    node = NodeConfig(dram_bytes=dram_bytes, prefault=args.prefault)
    transfer = TransferConfig(host=args.host, port=args.node_port, num_rails=args.node_rails,
                              secret=secret)
    store = HostedStore(HostedConfig(config, node, args.host, args.port, args.node_id),
                        transfer_config=transfer, secret=secret)
    store.start()
    log.info("master listening on %s (hosting node %s, segment server %s)", store.address,
             store.node.node_id, store.node.engine.address)
    return _serve_then_close(args, store.service.stats, store.close,
                             "master and its node stopped", stop)


def _serve_then_close(args: argparse.Namespace, stats: Any, close: Callable[[], None],
                      stopped: str, stop: threading.Event) -> int:
    """Serve /metrics (with --metrics-port) and log stats until SIGTERM / SIGINT, then close."""
    metrics = _serve_metrics(stats, args.host, args.metrics_port)
    try:
        _serve_until_signal(stats, args.stats_interval_s, stop)
    finally:
        if metrics is not None:
            metrics.shutdown()
        close()
        log.info(stopped)
    return 0


def _serve_metrics(stats: Any, host: str, port: int | None) -> Any:
    """The master's own /metrics (store/metrics.py) on an HTTP thread; None without a port."""
    if port is None:
        return None
    from prometheus_client import CollectorRegistry, start_http_server

    from kvcake.store.metrics import StoreMasterCollector

    registry = CollectorRegistry(auto_describe=True)
    registry.register(StoreMasterCollector(stats))
    http, _thread = start_http_server(port, host, registry)
    log.info("master /metrics on %s:%d", host, http.server_port)
    return http


def _run_elected_master(args: argparse.Namespace, config: MasterConfig,
                        stop: threading.Event) -> int:
    """Stand by until elected, then lead (store/elected.py); exit 1 if the lease is lost."""
    from kvcake.registry import Etcd
    from kvcake.store.elected import ElectedMaster

    master = ElectedMaster(Etcd(args.etcd), args.cluster, config, host=args.host,
                           port=args.port, advertise_host=_advertised(args),
                           secret=_secret(args), recovery_s=args.recovery_s)
    master.start()
    try:
        next_report_s = time.monotonic() + args.stats_interval_s
        while not stop.wait(0.2):
            if master.lost.is_set():
                return 1
            if master.ready.is_set() and time.monotonic() >= next_report_s:
                log.info("stats %s", json.dumps(master.service.stats(), sort_keys=True))
                next_report_s += args.stats_interval_s
        return 0
    finally:
        master.close()
        log.info("master %s stopped", master.address)


def _stop_on_signal() -> threading.Event:
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


def run_node(args: argparse.Namespace) -> int:
    from kvcake.store.node import StoreNode
    from kvcake.transfer import TransferConfig

    config = NodeConfig(dram_bytes=parse_size(args.dram, "--dram"), disk_dir=args.disk,
                        disk_bytes=parse_size(args.disk_size, "--disk-size") if args.disk else 0,
                        heartbeat_interval_s=args.heartbeat_interval_s, prefault=args.prefault)
    if (args.master is None) == (args.etcd is None):
        raise ValueError("--master/--etcd: give exactly one (HOST:PORT of a master, or the etcd "
                         "that knows the elected one)")
    master = args.master or f"etcd://{args.etcd}/{args.cluster}"
    advertise = _advertised(args)
    transfer = TransferConfig(host=args.host, port=args.port, num_rails=args.rails,
                              secret=_secret(args), advertise_host=advertise)
    _logging()
    stop = _stop_on_signal()  # before starting: a SIGTERM during the start stops it cleanly
    node = StoreNode(config, master, node_id=args.node_id, transfer_config=transfer,
                     host=args.host, advertise_host=advertise)
    try:
        node.start()
    except MasterUnavailable as exc:
        node.close(unregister=False)
        raise ValueError(f"--master: {exc}; is `kvcake store master` running there?") from None
    registration = None
    if args.etcd:
        from kvcake.registry import Etcd, Member, Registration

        member = Member("store_node", node.node_id, node.engine.address)
        registration = Registration(Etcd(args.etcd), args.cluster, member).start()
    log.info("node %s joined %s; segment server %s", node.node_id, master, node.engine.address)
    try:
        _serve_until_signal(node.stats, args.stats_interval_s, stop)
    finally:
        if registration is not None:
            registration.close()
        node.close()
        log.info("node %s left the pool", node.node_id)
    return 0
