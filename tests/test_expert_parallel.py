"""Expert parallelism through the Engine against one process from the same init (fp32, aux loss off, 1e-5):
transformers' Qwen3-MoE and Mixtral, 8 experts, top-2, trained three AdamW steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._moe_common import reference, train_ranks

TOL = 1e-5


def _close(results: list[dict[str, Any]], ref: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    ref_losses, ref_state = ref
    for r, res in enumerate(results):
        assert res["losses"] == pytest.approx(ref_losses, abs=TOL), r
    state = results[0]["state"]
    assert set(state) == set(ref_state)
    worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    assert worst < TOL, worst
    for k in ref_state:
        assert state[k].shape == ref_state[k].shape, k


@pytest.mark.parametrize("kind", ["qwen3", "mixtral"])
def test_ep2_ddp_on_two_ranks(run_ranks: Any, kind: str) -> None:
    _close(run_ranks(train_ranks, 2, kind, {"strategy": "ddp", "ep_size": 2}), reference(kind))


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_ep2_under_zero_on_four_ranks(run_ranks: Any, strategy: str) -> None:
    _close(run_ranks(train_ranks, 4, "qwen3", {"strategy": strategy, "ep_size": 2}), reference("qwen3"))


def test_ep2_by_tp2_on_four_ranks(run_ranks: Any) -> None:
    # The model's own tp plan splits every expert (moe_tp_experts), its ep plan cuts the experts over the ep ranks.
    _close(run_ranks(train_ranks, 4, "qwen3", {"strategy": "ddp", "ep_size": 2, "tp_size": 2}), reference("qwen3"))


def test_ep2_by_pp2_on_four_ranks(run_ranks: Any) -> None:
    # The model as the pipeline's blocks: two stages, each with two ep ranks.
    from tests._moe_common import pipeline_reference, train_pipeline

    options = {"pp_size": 2, "ep_size": 2, "pp_microbatches": 2}
    _close(run_ranks(train_pipeline, 4, "qwen3", options), pipeline_reference("qwen3"))
