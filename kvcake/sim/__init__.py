"""Discrete-event cluster simulator driving the unchanged Conductor (issue 3, DESIGN.md section 1).

Public API:
    simulate(SimConfig, Trace) -> SimResult(summary, states)      (run.py, config.py)
    Cluster(SimConfig, arrivals).run() -> summary                  (cluster.py)
    load_trace, Trace, TraceRequest; generate_trace, TraceGenConfig (trace.py, tracegen.py)
    run_experiment(name, trace_path, out_dir, SimConfig(...)) -> Report (.path, .data) (reproduce.py)
    lru_hit_rate(trace, capacity_tokens)                           (hitrate.py)
"""
