"""Early rejection (seed section IX.A, VII): refuse a request the SLOs say would be served late,
before any of its work is done, with a Retry-After estimate.

`Admission.NONE`: everything is placed. `SLO`: the predicted TTFT and the chosen decode
instance's TBT with the request added to its outstanding load now (its batch and the requests
dispatched to it still in prefill). `EARLY`: the same, with the decode batch forecast at
the moment the request joins it (after its predicted TTFT). `DECODE_AFTER_PREFILL`: the TTFT at
arrival, the decode side only once the prefill is done (`Conductor.admit_decode`), which SLO and
EARLY also do with `decode_check_after_prefill`.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from kvcake.conductor.config import Admission, ConductorConfig
from kvcake.conductor.decision import (
    DecodeEstimate,
    LazyPrefillCandidates,
    Rejection,
    RejectReason,
    ScheduleRequest,
)
from kvcake.conductor.load import DecodeLoad


class AdmissionControl:
    """The SLO checks of `config.admission` over the live `decodes` books."""

    def __init__(self, config: ConductorConfig, decodes: dict[str, DecodeLoad]) -> None:
        self.config = config
        self._decodes = decodes

    @property
    def checks_decode_after_prefill(self) -> bool:
        """Whether the decode side is (also) checked once the prefill is done."""
        admission = self.config.admission
        if admission is Admission.DECODE_AFTER_PREFILL:
            return True
        return self.config.decode_check_after_prefill and admission in (Admission.SLO,
                                                                        Admission.EARLY)

    def no_instance(self, request_id: str) -> Rejection:
        """No prefill or no decode instance to place on (none registered yet, or all gone)."""
        return Rejection(request_id, RejectReason.NO_INSTANCE, self.config.min_retry_after_s,
                         float("inf"), float("inf"), (), ())

    def at_arrival(self, req: ScheduleRequest, now_s: float, ttft_s: float,
                   decode: DecodeEstimate, candidates: LazyPrefillCandidates,
                   decode_candidates: tuple[DecodeEstimate, ...]) -> Rejection | None:
        """The rejection of `req`, placed with predicted `ttft_s` and decoding on `decode`, or
        None to place it. Retry after the TTFT excess, or when the decode instance next frees
        a request."""
        cfg = self.config
        if cfg.admission is Admission.NONE:
            return None
        if ttft_s > cfg.ttft_slo_s:
            reason, retry_s = RejectReason.TTFT_SLO, ttft_s - cfg.ttft_slo_s
        elif cfg.admission is Admission.DECODE_AFTER_PREFILL:
            return None  # the decode side is asked later, by admit_decode
        elif decode.tbt_s > cfg.tbt_slo_s:
            at_s = now_s + ttft_s if cfg.admission is Admission.EARLY else now_s
            next_finish = self._decodes[decode.instance_id].next_finish_after(at_s)
            reason, retry_s = RejectReason.TBT_SLO, (0.0 if next_finish is None else next_finish - now_s)
        else:
            return None
        return Rejection(req.request_id, reason, max(cfg.min_retry_after_s, retry_s), ttft_s,
                         decode.tbt_s, candidates.expand(), decode_candidates)

    def after_prefill(self, request_id: str, best: DecodeEstimate, now_s: float,
                      estimates: tuple[DecodeEstimate, ...]) -> Rejection | None:
        """The rejection of a prefilled request whose best decode instance `best` still
        exceeds the TBT SLO (its prefill was spent for nothing), or None to let it decode."""
        if best.tbt_s <= self.config.tbt_slo_s:
            return None
        next_finish = self._decodes[best.instance_id].next_finish_after(now_s)
        retry_s = 0.0 if next_finish is None else next_finish - now_s
        return Rejection(request_id, RejectReason.TBT_SLO,
                         max(self.config.min_retry_after_s, retry_s), 0.0, best.tbt_s, (),
                         estimates)
