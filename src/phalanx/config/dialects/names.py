"""The few value spellings that the dialects share: Accelerate's ``mixed_precision`` and DeepSpeed's ZeRO stage.

Used by the config files (``accelerate.py``, ``deepspeed.py``) and by the launcher's flags (``--mixed_precision``,
``--zero_stage``), so that a value means the same wherever it is written.
"""

from __future__ import annotations

from typing import Any

from phalanx.config.options import ConfigError

__all__ = ["precision_from_accelerate", "strategy_from_zero_stage", "ACCELERATE_PRECISIONS", "FOREIGN_KEYS"]

ACCELERATE_PRECISIONS = {"no": "fp32", "fp16": "fp16-mixed", "bf16": "bf16-mixed"}
_ZERO_STAGES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}


def precision_from_accelerate(value: Any, key: str = "mixed_precision") -> str:
    """Accelerate's ``no`` / ``fp16`` / ``bf16`` as phalanx's precision. YAML reads a bare ``no`` as False."""
    text = "no" if value is False or value is None else str(value).lower()
    if text in ACCELERATE_PRECISIONS:
        return ACCELERATE_PRECISIONS[text]
    if text == "fp8":
        raise ConfigError(
            f"{key}='fp8' is not supported by phalanx (fp8 needs Transformer Engine or torchao kernels); use "
            f"{key}: bf16 (phalanx's bf16-mixed), or no"
        )
    raise ConfigError(f"invalid {key}: got {value!r} (use one of: {', '.join(ACCELERATE_PRECISIONS)})")


def strategy_from_zero_stage(value: Any, key: str = "zero_stage") -> str:
    """DeepSpeed's ZeRO stage 0-3 as the phalanx strategy that does the same (stage 0 is plain data parallelism)."""
    try:
        stage = int(value)
    except (TypeError, ValueError):
        stage = -1
    if stage not in _ZERO_STAGES or isinstance(value, bool):
        raise ConfigError(f"invalid {key}: got {value!r} (ZeRO stages are 0, 1, 2 and 3)")
    return _ZERO_STAGES[stage]


# Keys of other tools that people write into a phalanx YAML, with what to write instead.
FOREIGN_KEYS = {
    "zero_stage": "write strategy: zero1, zero2 or zero3 (zero_stage is DeepSpeed's name; pp_zero_stage is the "
    "pipeline's own ZeRO-1)",
    "stage": "write strategy: zero1, zero2 or zero3",
    "mixed_precision": "write precision: bf16-mixed or fp16-mixed (or fp32)",
    "gradient_accumulation_steps": "write grad_accum_steps",
    "num_processes": "write launch: {nproc_per_node: N}",
    "gradient_clipping": "write max_grad_norm",
}
