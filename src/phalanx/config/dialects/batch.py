"""DeepSpeed's batch rule, which phalanx keeps for ``global_batch_size`` and ``micro_batch_size`` too.

    global batch = micro batch (per rank) x accumulation steps x data-parallel size

Two of the three numbers give the third; when all three are given they must agree, and the error names each number,
where it came from, the world size it was checked against, and the values that would make it hold.
"""

from __future__ import annotations

from typing import Any

from phalanx.config.options import ConfigError

__all__ = ["apply_batch_rule"]


def apply_batch_rule(
    values: dict[str, Any], origins: dict[str, str], world: int, pp: int = 1, tp: int = 1, cp: int = 1
) -> None:
    """Fill in the third of global batch, micro batch and accumulation steps from the other two, or check that all
    three agree. ``values`` and ``origins`` are the config's, keyed by setting name; they are updated in place."""
    glob, micro = values.get("global_batch_size"), values.get("micro_batch_size")
    if glob is None and micro is None:
        return
    dp = max(1, world // (pp * tp * cp))
    accum = values.get("grad_accum_steps", 1)
    accum_set = "grad_accum_steps" in origins

    def said(key: str) -> str:
        return f"{key}={values[key]} ({origins.get(key, 'default')})"

    world_text = (
        f"data-parallel size {dp} (world size {world}"
        + (f", {pp} pipeline stages" if pp > 1 else "")
        + (f", tensor-parallel size {tp}" if tp > 1 else "")
        + (f", context-parallel size {cp}" if cp > 1 else "")
        + ")"
    )
    if glob is not None and micro is not None and not accum_set:
        if glob % (micro * dp):
            raise ConfigError(
                f"{said('global_batch_size')} is not a multiple of {said('micro_batch_size')} x "
                f"{world_text} = {micro * dp}: change one of them, or the number of ranks"
            )
        values["grad_accum_steps"], origins["grad_accum_steps"] = (
            glob // (micro * dp),
            "batch rule: global / (micro x dp)",
        )
        return
    if glob is not None and micro is None:
        if glob % (accum * dp):
            raise ConfigError(
                f"{said('global_batch_size')} is not a multiple of grad_accum_steps={accum} x "
                f"{world_text} = {accum * dp}: change one of them, or the number of ranks"
            )
        values["micro_batch_size"], origins["micro_batch_size"] = (
            glob // (accum * dp),
            "batch rule: global / (accum x dp)",
        )
        return
    assert micro is not None
    if glob is None:
        values["global_batch_size"], origins["global_batch_size"] = micro * accum * dp, "batch rule: micro x accum x dp"
        return
    if glob != micro * accum * dp:
        fixes = [f"global_batch_size {micro * accum * dp}"]
        if glob % (micro * dp) == 0:
            fixes.append(f"grad_accum_steps {glob // (micro * dp)}")
        if glob % (accum * dp) == 0:
            fixes.append(f"micro_batch_size {glob // (accum * dp)}")
        if glob % (micro * accum) == 0 and glob // (micro * accum) * pp != world:
            fixes.append(f"{glob // (micro * accum) * pp} ranks")
        raise ConfigError(
            f"the batch sizes disagree: {said('global_batch_size')} must equal {said('micro_batch_size')} x "
            f"{said('grad_accum_steps')} x {world_text} = {micro * accum * dp}. With the others kept, use "
            + ", or ".join(fixes)
        )
