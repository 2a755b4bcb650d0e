"""The paper's published figures that `kvcake reproduce` puts beside ours (seed sections IX, X).

Only numbers the paper states are here; where it gives a shape instead of numbers (Figures 9, 13
and 15) the claim is kept as a sentence.
"""

from __future__ import annotations

# Figure 5: average TTFT (s), conversation trace, 16 nodes of 8xA800 (8 prefill + 8 decode assumed).
FIGURE5_TTFT_S = {"random": 19.65, "load_balance": 5.27, "local_cache": 3.58, "global_cache": 3.07}
FIGURE5_CLAIM = "global_cache cuts average TTFT by a further 14% versus local_cache"

FIGURE9_CLAIM = ("one node's DRAM (~3M tokens of llama3-70b KV) reaches less than half of the "
                 "maximum hit rate; ~50M tokens (20+ nodes pooled) come near the maximum")

FIGURE10_CLAIM = ("a global cache raises the hit rate by up to 2.36x over local caches and cuts "
                  "prefill GPU time to as low as 0.52x")
FIGURE10_MAX_HIT_RATIO = 2.36
FIGURE10_MIN_PREFILL_RATIO = 0.52

FIGURE13_CLAIM = ("sweeping 24..400 Gbps: above ~100 Gbps average TTFT stays low (under ~2 s on "
                  "synthetic, below recomputation); below ~100 Gbps it rises steeply as transfers "
                  "congest")

FIGURE15_CLAIM = ("effective request capacity peaks near a 1:1 prefill:decode split; more prefill "
                  "nodes lower TTFT and raise TBT, and vice versa")

# Effective request capacity gains of MOONCAKE over the best vLLM baseline, by TBT threshold
# (100 / 200 / 300 ms). Conversation: Figure 1 gives only the ends of the range.
CAPACITY_GAIN = {
    "conversation": {100: 4.98, 300: 0.59},
    "synthetic": {100: 0.62, 200: 0.40, 300: 0.28},
}

# Figure 8: prefill GPU time of each baseline as a multiple of MOONCAKE's. "vllm" is derived:
# MOONCAKE cuts prefill time by 36% (conversation) and 64% (synthetic) versus vanilla vLLM.
PREFILL_TIME_RATIO = {
    "conversation": {"vllm": 1 / 0.64, "vllm_prefix_caching": 1.43, "vllm_chunked_prefill": 1.90},
    "synthetic": {"vllm": 1 / 0.36, "vllm_prefix_caching": 2.59, "vllm_chunked_prefill": 3.33},
}


def workload_of(trace_name: str) -> str | None:
    """"conversation" or "synthetic" when the trace file name says so, else None."""
    for name in ("conversation", "synthetic"):
        if name in trace_name:
            return name
    return None
