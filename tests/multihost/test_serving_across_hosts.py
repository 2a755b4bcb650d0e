"""kvcake served across three hosts (network namespaces), as docs/cluster.md runs it:

  host a: etcd, the frontend (`kvcake serve --etcd ... --prefill 0 --decode 0`), store master 1
  host b: a prefill worker, store master 2 (standby)
  host c: a decode worker (its store node holds the prefixes: the larger DRAM, most_free_first)

KV crosses hosts over TCP (own hostnames: no shared memory). Checked: greedy tokens equal the
offline engine's; a restarted prefill worker (empty local cache) reports cached tokens, which
only the store node on host c can have served; SIGKILL of store master 1 -> master 2 leads and
requests keep being served; SIGKILL of the decode worker mid-stream ends that stream with an
error, and a new decode worker on c registers and serves the next requests.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from kvcake import LLM, SamplingParams
from kvcake.auth import ClusterSecret
from kvcake.engine.config import EngineConfig
from kvcake.registry import Etcd
from kvcake.store import StoreClient
from kvcake.store.leader import leader_key
from kvcake.transfer import TransferConfig
from tests.multihost.netns import NetnsHosts

CLUSTER = "xserve"
KVCAKE = [sys.executable, "-m", "kvcake"]
ENGINE = ["--kv-cache-bytes", "16MiB", "--max-num-batched-tokens", "256"]


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if condition():
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def complete(url: str, prompt: list[int], max_tokens: int) -> dict:  # type: ignore[type-arg]
    reply = httpx.post(f"{url}/v1/completions", timeout=120.0, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def test_serving_across_three_hosts(hosts: NetnsHosts, etcd_on_a: object,
                                    tmp_path: Path) -> None:
    endpoint = etcd_on_a.endpoint  # type: ignore[attr-defined]
    etcd = Etcd(endpoint)
    secret = tmp_path / "cluster.secret"  # every host's processes prove the same secret
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    common = ["--etcd", endpoint, "--cluster", CLUSTER, "--secret-file", str(secret)]
    a = hosts.ip("a")
    config = tmp_path / "cluster.toml"  # the frontend's file: docs/cluster.md, step 4
    config.write_text(f"""model = "tiny"
[frontend]
host = "{a}"
port = 24080
[engine]
kv_cache_bytes = "16MiB"
max_num_batched_tokens = 256
[security]
secret_file = "{secret}"
[etcd]
endpoints = ["{endpoint}"]
cluster = "{CLUSTER}"
""")
    masters = {h: hosts.spawn(h, [*KVCAKE, "store", "master", "--host", hosts.ip(h), "--port",
                                  "0", "--strategy", "most_free_first", *common],
                              name=f"master-{h}") for h in ("a", "b")}
    wait_until(lambda: etcd.get(leader_key(CLUSTER)) is not None, "a store leader")
    leader = (etcd.get(leader_key(CLUSTER)) or b"").decode()
    leader_host = next(h for h in ("a", "b") if leader.startswith(hosts.ip(h) + ":"))

    def worker(host: str, role: str, dram: str) -> object:
        return hosts.spawn(host, [*KVCAKE, "worker", "--role", role, "--host", hosts.ip(host),
                                  "--worker-id", f"{role}-{host}", "--num-threads", "1",
                                  "--store-dram-bytes", dram, *ENGINE, *common],
                           name=f"{role}-{host}")

    frontend = hosts.spawn("a", [*KVCAKE, "serve", "--config", str(config)], name="frontend")
    prefill = worker("b", "prefill", "8MiB")
    decode = worker("c", "decode", "64MiB")
    url = f"http://{a}:24080"
    wait_until(lambda: httpx.get(f"{url}/health").json().get("workers") == 2, "two workers")
    assert frontend.poll() is None

    rng = np.random.default_rng(3)
    shared = rng.integers(0, 256, 160).tolist()
    prompts = [shared + rng.integers(0, 256, 20).tolist() for _ in range(3)]
    llm = LLM("tiny", EngineConfig(kv_cache_bytes=16 << 20, max_num_batched_tokens=256))
    expected = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8,
                                                                         ignore_eos=True))]
    first = complete(url, prompts[0], 8)
    assert first["choices"][0]["token_ids"] == expected[0]
    # The prefill worker writes the prompt's blocks to the store after answering: wait until
    # they are committed (on host c's node, the one with room) before killing it.
    store = StoreClient(f"etcd://{endpoint}/{CLUSTER}", transfer_config=TransferConfig(
        serve=False, use_shared_memory=False, secret=ClusterSecret.from_file(secret)))
    num_blocks = len(prompts[0]) // 16
    wait_until(lambda: store.master.stats()["num_objects"] >= num_blocks, "the prefix stored")
    store.close()

    # The prefill worker restarts with an empty cache: the shared prefix now comes from the
    # store node on host c (the other store node died with the old prefill process).
    prefill.kill()  # type: ignore[attr-defined]
    wait_until(lambda: httpx.get(f"{url}/health").json().get("workers") == 1, "prefill gone")
    worker("b", "prefill", "8MiB")
    wait_until(lambda: httpx.get(f"{url}/health").json().get("workers") == 2, "prefill back")
    second = complete(url, prompts[1], 8)
    assert second["choices"][0]["token_ids"] == expected[1]
    cached = second["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert cached >= 144, second["usage"]  # the shared prefix's full blocks, from host c

    # Store master failover while serving.
    killed_at = time.monotonic()
    masters[leader_host].kill()
    def standby_leads() -> bool:  # one read: the key is briefly absent between two leaders
        leader = etcd.get(leader_key(CLUSTER))
        return leader is not None and not leader.decode().startswith(hosts.ip(leader_host) + ":")

    wait_until(standby_leads, "the standby store master to lead", 30.0)
    without_master_s = time.monotonic() - killed_at
    third = complete(url, prompts[2], 8)
    assert third["choices"][0]["token_ids"] == expected[2]

    # The decode worker dies mid-stream: that stream ends with an error; a new one serves.
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120.0, json={
            "prompt": prompts[0], "max_tokens": 400, "temperature": 0.0, "ignore_eos": True,
            "stream": True}) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        decode.kill()  # type: ignore[attr-defined]
        rest = [line for line in lines if line.startswith("data:")]
    assert rest and rest[-1] == "data: [DONE]" or any('"error"' in line for line in rest), rest
    assert any('"error"' in line for line in rest), rest[-3:]
    rejoined_at = time.monotonic()
    worker("c", "decode", "64MiB")
    wait_until(lambda: httpx.get(f"{url}/health").json().get("workers") == 2, "decode back")
    rejoin_s = time.monotonic() - rejoined_at
    again = complete(url, prompts[2], 8)
    assert again["choices"][0]["token_ids"] == expected[2]
    print(json.dumps({"store_leader_change_s": round(without_master_s, 2),
                      "decode_worker_rejoin_s": round(rejoin_s, 2),
                      "cached_tokens_from_host_c": cached}))
