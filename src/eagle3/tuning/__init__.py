"""Pick the draft shape (chain length or tree) that maximises predicted tokens/s on one device.

`model` predicts tokens/s from measured step costs and acceptance; `cache` keeps tuning results per device.
"""

from eagle3.tuning.cache import (
    TuningStore,
    device_description,
    drafter_store,
    find_tuning,
    tuning_key,
    user_store,
)
from eagle3.tuning.model import (
    AcceptanceProfile,
    Costs,
    Prediction,
    candidate_shapes,
    choose,
    cycle_seconds,
    predict,
    predict_all,
)

__all__ = [
    "AcceptanceProfile",
    "Costs",
    "Prediction",
    "TuningStore",
    "candidate_shapes",
    "choose",
    "cycle_seconds",
    "device_description",
    "drafter_store",
    "find_tuning",
    "predict",
    "predict_all",
    "tuning_key",
    "user_store",
]
