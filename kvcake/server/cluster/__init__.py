"""The frontend's side of a cluster: `DisaggBackend` (the Conductor, the requests in flight,
the worker links, liveness, the store audit) and the launcher that starts the cluster."""
