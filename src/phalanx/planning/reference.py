"""The published model-state figures the planner is checked against: the ZeRO paper's Table 1 and DeepSpeed's own
estimators.

- Rajbhandari, Rasley, Ruwase, He, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (2019),
  section 5 and Table 1: mixed-precision Adam holds 2 Psi of fp16 parameters, 2 Psi of fp16 gradients and K Psi of
  optimizer state (K = 12: the fp32 master, momentum and variance) per device; P_os shards the optimizer state over
  N devices, P_os+g the gradients too, P_os+g+p the parameters too.
- DeepSpeed 0.19.6 (``deepspeed/runtime/zero/stage_1_and_2.py: estimate_zero2_model_states_mem_needs`` and
  ``stage3.py: estimate_zero3_model_states_mem_needs``), the formulas as written there, including the 1.5
  ``additional_buffer_factor`` on host memory. The zero2 formula without offload is the one since DeepSpeed 0.14.3
  (2 Psi + 18 Psi / N, PR #5099); the figures in DeepSpeed's docs/code-docs/source/memory.rst predate it
  (4 Psi + 16 Psi / N).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["zero_paper_bytes", "deepspeed_zero2", "deepspeed_zero3", "DeepSpeedRow", "deepspeed_rows"]


def zero_paper_bytes(psi: float, n: int, k: float = 12) -> dict[str, float]:
    """Model-state bytes per device in the ZeRO paper: the baseline (2 + 2 + K) Psi, P_os 2 Psi + 2 Psi + K Psi / N,
    P_os+g 2 Psi + (2 + K) Psi / N, P_os+g+p (2 + 2 + K) Psi / N."""
    return {
        "baseline": (2 + 2 + k) * psi,
        "os": 2 * psi + 2 * psi + k * psi / n,
        "os+g": 2 * psi + (2 + k) * psi / n,
        "os+g+p": (2 + 2 + k) * psi / n,
    }


def deepspeed_zero2(
    total_params: float,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """(cpu_mem, gpu_mem) as DeepSpeed's ``estimate_zero2_model_states_mem_needs``."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        # 2: 16-bit parameters; 18: 16-bit and fp32 gradients, fp32 parameters, Adam's two moments
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def deepspeed_zero3(
    total_params: float,
    largest_layer_params: float,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """(cpu_mem, gpu_mem, largest_layer_memory) as DeepSpeed's ``estimate_zero3_model_states_mem_needs``."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), int(largest_layer_memory)


@dataclass(frozen=True)
class DeepSpeedRow:
    """One line of DeepSpeed's ``estimate_zero{2,3}_model_states_mem_needs_all_cold`` printout."""

    stage: int
    options: str
    cpu_bytes: int
    gpu_bytes: int


def deepspeed_rows(
    total_params: float, largest_layer_params: float, num_gpus_per_node: int, num_nodes: int
) -> list[DeepSpeedRow]:
    """Every line DeepSpeed's two ``all_cold`` estimators print, in their order."""
    rows = []
    for offload in (True, False):
        cpu, gpu = deepspeed_zero2(total_params, num_gpus_per_node, num_nodes, offload)
        rows.append(DeepSpeedRow(2, f"offload_optimizer={'cpu ' if offload else 'none'}", cpu, gpu))
    for offload in (True, False):
        for offload_params in (True, False):
            if not offload and offload_params:
                continue
            for zero_init in (True, False):
                cpu, gpu, _ = deepspeed_zero3(
                    total_params, largest_layer_params, num_gpus_per_node, num_nodes, offload, offload_params, zero_init
                )
                options = (
                    f"offload_param={'cpu ' if offload_params else 'none'}, "
                    f"offload_optimizer={'cpu ' if offload else 'none'}, zero_init={int(zero_init)}"
                )
                rows.append(DeepSpeedRow(3, options, cpu, gpu))
    return rows
