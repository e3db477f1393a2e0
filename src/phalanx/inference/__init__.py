"""Big-model inference: place a model that does not fit over GPUs, host memory and disk, and run it.

    with phalanx.init_empty_weights():
        model = build_model()                                          # nothing allocated
    model = phalanx.load_and_dispatch(model, "weights/", max_memory={"cpu": "2GiB"})
    model.hf_device_map                                                # where each part lives

``plan.py`` decides where each part goes; ``dispatch.py`` places the weights and streams the disk ones at each forward.
"""

from phalanx.inference.dispatch import dispatch, load_and_dispatch
from phalanx.inference.plan import DispatchError, check_device_map, init_empty_weights, parse_bytes, plan_device_map

__all__ = [
    "DispatchError",
    "check_device_map",
    "dispatch",
    "init_empty_weights",
    "load_and_dispatch",
    "parse_bytes",
    "plan_device_map",
]
