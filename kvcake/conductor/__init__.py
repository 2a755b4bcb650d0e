"""The Conductor: KVCache-centric global scheduling, its cost model and predictors (pure).

Public API (stable; the simulator and the live frontend build on it):
    Conductor, ConductorConfig, Policy, Admission                  (conductor.py, config.py)
    ScheduleRequest, Placement, Rejection, RejectReason, FetchPlan,
    PrefillEstimate, DecodeEstimate, Decision                      (decision.py)
    GlobalIndex, PrefixMatch                                       (index.py)
    PrefillQueue, DecodeLoad                                       (load.py)
    freeze_heap                                                    (heap.py)
    CostModel; ModelProfile, HardwareProfile, parse_profile,
    model_profile_from_shape, MODEL_PROFILES, HARDWARE_PROFILES     (cost.py, profiles.py)
    PrefillModel, DecodeModel, PrefillTimePredictor, DecodeStepPredictor,
    PrefillPoint, DecodePoint, profile_grid                        (predictor.py)
"""

from kvcake.conductor.conductor import Conductor
from kvcake.conductor.config import Admission, ConductorConfig, Policy
from kvcake.conductor.cost import CostModel
from kvcake.conductor.decision import (
    Decision,
    DecodeEstimate,
    FetchPlan,
    Placement,
    PrefillEstimate,
    Rejection,
    RejectReason,
    ScheduleRequest,
)
from kvcake.conductor.heap import freeze_heap
from kvcake.conductor.index import GlobalIndex, PrefixMatch
from kvcake.conductor.load import DecodeLoad, PrefillQueue
from kvcake.conductor.predictor import (
    DecodeModel,
    DecodePoint,
    DecodeStepPredictor,
    PrefillModel,
    PrefillPoint,
    PrefillTimePredictor,
    profile_grid,
)
from kvcake.conductor.profiles import (
    HARDWARE_PROFILES,
    MODEL_PROFILES,
    HardwareProfile,
    ModelProfile,
    model_profile_from_shape,
    parse_profile,
)

__all__ = [
    "HARDWARE_PROFILES", "MODEL_PROFILES", "Admission", "Conductor", "ConductorConfig",
    "CostModel", "DecodeEstimate", "DecodeLoad", "PrefillQueue", "DecodeModel", "DecodePoint", "DecodeStepPredictor",
    "Decision", "FetchPlan", "GlobalIndex", "HardwareProfile", "ModelProfile", "Placement",
    "Policy", "PrefillEstimate", "PrefillModel", "PrefillPoint", "PrefillTimePredictor",
    "PrefixMatch", "RejectReason", "Rejection", "ScheduleRequest", "model_profile_from_shape",
    "freeze_heap", "parse_profile", "profile_grid",
]
