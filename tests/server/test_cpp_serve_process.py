"""`kvcake serve --config FILE` with a CPP group, as a user runs it: worker processes (1 plain
prefill, 1 decode, 2 CPP stages each loading half of the layers), a long prompt through the group
over HTTP gives the offline engine's greedy tokens, a short one takes the plain path, and
SIGTERM stops every child."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvcake import LLM, SamplingParams
from kvcake.engine.config import EngineConfig
from tests.server.test_disagg_serve import alive, children_of

pytestmark = pytest.mark.slow  # four worker processes start (about 15 s on 2 loaded cores)

TOML = """
model = "tiny"
profile_dir = "{profiles}"
[frontend]
port = 0
[engine]
kv_cache_bytes = "8MiB"
[conductor]
admission = "none"
cpp_min_tokens = 100
cpp_nodes = 2
cpp_chunk_tokens = 40
cpp_min_chunk_tokens = 16
[[workers]]
role = "prefill"
[[workers]]
role = "decode"
[[workers]]
role = "cpp"
count = 2
"""


def test_serve_with_a_cpp_group(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    profiles = tmp_path_factory.getbasetemp() / "kvcake-profiles"  # shared by the session
    config = tmp_path / "cluster.toml"
    config.write_text(TOML.format(profiles=profiles))
    proc = subprocess.Popen([sys.executable, "-m", "kvcake", "serve", "--config", str(config),
                             "--log-level", "warning"], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        url = None
        deadline = time.monotonic() + 180
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "the server exited before serving"
            match = re.search(r"kvcake serve: (http://\S+)", line)
            url = match.group(1) if match else None
        assert url is not None
        workers = children_of(proc.pid)
        assert len(workers) == 4
        llm = LLM("tiny", config=EngineConfig(kv_cache_bytes=8 << 20))
        for n in (230, 60):  # the group (6 chunks), then the plain path
            prompt = np.random.default_rng(n).integers(0, 256, n).tolist()
            reply = httpx.post(url + "/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert reply.status_code == 200, reply.text
            want = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))
            assert reply.json()["choices"][0]["token_ids"] == want[0].token_ids
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert re.search(r'live_workers\{[^}]*role="cpp"[^}]*\} 2\.0', metrics), metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 20
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in workers)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
