"""The systems `benchmarks/serving_disagg_vs_colocated.py` serves, one at a time on 127.0.0.1:
the cluster TOML of the disaggregated pair (`--disagg-admission` on the regime's SLOs) and of the
colocated pair (`kvcake_toml`, `conductor_toml`), and `Served`, a started system (kvcake through
`kvcake serve --config`, vLLM through benchmarks/bench_servers.py) with its warm-up, counters
and replay.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_servers as servers  # noqa: E402
from serving_probes import warm_up  # noqa: E402

from kvcake.bench.regime import Regime  # noqa: E402
from kvcake.bench.replay import PlannedRequest, ReplayConfig, replay  # noqa: E402
from kvcake.bench.stats import RequestResult  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("colocated-budget", "disagg", "colocated", "vllm")  # each step's own port range
MAX_MODEL_LEN = 32768
KV_CACHE = "1GiB"  # per kvcake worker: 262,144 fp32 tokens of this model (vLLM: 2 GiB, 1 server)


def conductor_toml(kind: str, admission: str, regime: Regime,
                   prefill_speed_weight: float = 0.0) -> str:
    """The Conductor's section: the disaggregated pair's admission (`--disagg-admission`) checks
    the regime's TTFT SLO and its loosest TBT SLO at arrival (one replay still gives the share at
    every TBT SLO: an admitted request that misses a tighter one counts as a miss there); the
    colocated pair never rejects, as vLLM (and the simulator's colocated baselines) do not.
    `prefill_speed_weight` (`--prefill-speed-weight`, both pairs; 0: not written, the default):
    each Conductor learns its prefill instances' speed (kvcake/conductor/config.py)."""
    policy = "colocated" if kind == "colocated" else "global_cache"
    speed = f"prefill_speed_weight = {prefill_speed_weight!r}\n" if prefill_speed_weight else ""
    if kind == "colocated" or admission == "none":
        return f'[conductor]\nadmission = "none"\npolicy = "{policy}"\n' + speed
    return (f'[conductor]\nadmission = "{admission}"\npolicy = "{policy}"\n'
            f"ttft_slo_s = {regime.ttft_slo_s!r}\n"
            f"tbt_slo_s = {max(regime.tbt_slos_ms) / 1000.0!r}\n" + speed)


def kvcake_toml(kind: str, args: argparse.Namespace, port: int, budget: int | None,
                regime: Regime, pin: bool | None = None) -> str:
    """The cluster TOML of a kvcake system (`pin`: its `pin_workers`; None: the default, on)."""
    engine = (f'[engine]\ndtype = "float32"\nmax_model_len = {MAX_MODEL_LEN}\n'
              f'kv_cache_bytes = "{KV_CACHE}"\n')
    if budget is not None:
        engine += f"max_num_batched_tokens = {budget}\n"
    pinning = "" if pin is None else f"pin_workers = {str(pin).lower()}\n"
    mode = "colocated" if kind == "colocated" else "disaggregated"
    head = (pinning + f'model = "{args.model_dir}"\nmode = "{mode}"\n'
            f'[frontend]\nhost = "127.0.0.1"\nport = {port}\n'
            f'[store]\nmaster_host = "127.0.0.1"\nmaster_port = {port + 1}\n{engine}'
            + conductor_toml(kind, args.disagg_admission, regime, args.prefill_speed_weight))
    if kind == "colocated":
        return head + (f'[[workers]]\nrole = "colocated"\nport = {port + 2}\nnum_threads = 1\n'
                       f'[[workers]]\nrole = "colocated"\nport = {port + 3}\nnum_threads = 1\n')
    return head + (f'[[workers]]\nrole = "prefill"\nport = {port + 2}\nnum_threads = 1\n'
                   f'store_dram_bytes = "1GiB"\n'
                   f'[[workers]]\nrole = "decode"\nport = {port + 3}\nnum_threads = 1\n')


class Served:
    """One system started on 127.0.0.1 (context manager: stopped on exit)."""

    def __init__(self, kind: str, args: argparse.Namespace, regime: Regime,
                 budget: int | None = None, pin: bool | None = None) -> None:
        self.kind, self.args, self.regime, self.budget, self.pin = kind, args, regime, budget, pin
        self.port = args.port_base + 10 * STEPS.index(kind if kind in STEPS else "colocated")
        self.run_dir = args.out_dir / "run"
        self.server: servers.Server | None = None
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = ""

    def _server_args(self) -> argparse.Namespace:
        return argparse.Namespace(model_dir=self.args.model_dir, max_model_len=MAX_MODEL_LEN,
                                  vllm_bind="0-1", start_timeout_s=600.0)

    def __enter__(self) -> Served:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        if self.kind == "vllm":
            self.server = servers.start(servers.System("vllm", "float32"), self._server_args(),
                                        self.port, self.run_dir)
        else:
            toml = self.run_dir / f"{self.kind}.toml"
            toml.write_text(kvcake_toml(self.kind, self.args, self.port, self.budget,
                                         self.regime, self.pin))
            log = self.run_dir / f"{self.kind}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen([sys.executable, "-m", "kvcake", "serve", "--config",
                                         str(toml)], stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        cwd=ROOT)
            self.server = servers.Server(servers.System(self.kind, "float32"), self.url, proc, 0.0,
                                     proc.pid)  # its session (start_new_session)
            try:
                servers.wait_healthy(self.url, proc, 600.0, log)
            except BaseException:
                self.__exit__()
                raise
        import httpx

        self.model = str(httpx.get(f"{self.url}/v1/models", timeout=10.0).json()["data"][0]["id"])
        print(f"[{self.kind}] healthy after {time.monotonic() - started:.0f} s", file=sys.stderr,
              flush=True)
        warm_up(self.url, self.model, self.args.vocab_size, self.args.seed)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            servers.stop(self.server, self._server_args(), self.port, self.run_dir)
            self.server = None

    def counters(self) -> dict[str, float]:
        """The server's prefix-cache and KV counters (/metrics, summed over labels)."""
        import re

        import httpx

        try:
            text = httpx.get(f"{self.url}/metrics", timeout=10.0).text
        except httpx.HTTPError:
            return {}
        out: dict[str, float] = {}
        for name in ("prefix_cache_queries_total", "prefix_cache_hits_total",
                     "kv_transfer_bytes_total", "kv_stream_hidden_share",
                     "store_fetched_tokens_total", "num_preemptions_total"):
            found = re.findall(rf"^(?:vllm:|kvcake:){name}(?:{{[^}}]*}})? (\S+)$", text,
                               re.MULTILINE)
            if found:
                out[name] = sum(float(v) for v in found)
        return out

    def replay(self, planned: list[PlannedRequest]) -> tuple[list[RequestResult], float]:
        return asyncio.run(replay(planned, ReplayConfig(self.url, self.model)))
