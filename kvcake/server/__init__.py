"""The OpenAI-compatible server, in the order a request meets it.

- `frontend/`: the HTTP API over any `Backend` (the contract), the OpenAI protocol, metrics, and
  the in-process engine backend of `--mode single`;
- `cluster/`: the frontend's side of a cluster: the Conductor behind `Router`, the requests in
  flight, the links to every worker, liveness, the store audit, the launcher and its config;
- `worker/`: one prefill / decode / colocated worker process and the wire messages it speaks;
- `cli/`: `kvcake serve`, `kvcake worker`, `kvcake profile`.

Imports go one way: `cli` -> `cluster` -> `frontend`, `worker` (tests/server/test_layout.py).
"""
