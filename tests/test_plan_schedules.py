"""``phalanx plan`` under each pipeline schedule: the bubble and the micro-batches each rank holds, checked against
the pipeline package's own orders and simulator (``strategies/pipeline/actions.py``), the bytes zb_h1 keeps between
B and W against what ``split_backward`` really keeps, and the ``--pp-schedule`` / ``--pp-virtual-stages`` flags.
No processes are spawned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from phalanx.launch.cli import main
from phalanx.planning import Layout, PlanError, Workload, World, estimate, load_shape, plan, recommend, shape_of
from phalanx.planning.activations import deferred_bytes
from phalanx.planning.schedules import InFlight, bubble, in_flight
from phalanx.strategies.pipeline.actions import Action, schedule_orders, simulate

LLAMA3_8B = Path(__file__).resolve().parent / "data" / "plan" / "llama3-8b" / "config.json"


def _orders(schedule: str, p: int, m: int, v: int) -> list[list[Action]]:
    """The engine's orders; 1F1B and GPipe (which ``schedules.py`` runs without a list of actions) written the
    same way: 1F1B's warm-up of p - r - 1 forwards, then one forward and one backward in turn."""
    if schedule in ("interleaved_1f1b", "zb_h1"):
        return schedule_orders(schedule, p, v, m)
    out = []
    for r in range(p):
        warm = m if schedule == "gpipe" else min(p - r - 1, m)
        order: list[Action] = [("F", r, i) for i in range(warm)]
        for k in range(m - warm):
            order += [("F", r, warm + k), ("BW", r, k)]
        out.append(order + [("BW", r, i) for i in range(m - warm, m)])
    return out


CASES = [(s, p, m, 1) for s in ("gpipe", "1f1b", "zb_h1") for p in (2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 16)]
CASES += [("interleaved_1f1b", p, m, v) for p in (2, 4, 8) for v in (2, 3, 4) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_the_bubble_is_the_simulated_idle_time(schedule, p, m, v):
    # F = B = W = 1 for a whole stage: each of v chunks costs 1/v. Every rank idles the same share of the step.
    orders = _orders(schedule, p, m, v)
    run = simulate(orders, {"F": 1 / v, "B": 1 / v, "W": 1 / v, "BW": 2 / v})
    end = max(run["end"])
    for idle in run["idle"]:
        assert idle / end == pytest.approx(bubble(schedule, p, m, v), abs=1e-12)


def test_the_bubbles_against_the_published_ones():
    # Narayanan et al. 2021: interleaving divides the 1F1B bubble's idle time by v; Qi et al. 2023: ZB-H1 idles
    # (p-1)(F+B-W), a third of 1F1B's when F = B = W.
    for p, m in ((4, 8), (8, 16), (8, 32)):
        one = bubble("1f1b", p, m)
        assert one == pytest.approx((p - 1) / (m + p - 1))
        assert bubble("interleaved_1f1b", p, m, 2) == pytest.approx((p - 1) / (2 * m + p - 1))
        assert bubble("zb_h1", p, m) == pytest.approx((p - 1) / (3 * m + p - 1))
        assert bubble("zb_h1", p, m) < bubble("interleaved_1f1b", p, m, 2) < one == bubble("gpipe", p, m)


def _walk(order: list[Action], last_chunk: int) -> list[InFlight]:
    """What the rank holds after each action: forwards not yet released (by BW, or by W under zb_h1), of them
    the last chunk's (head and loss), and those whose B has run and W not."""
    held: set[tuple[int, int]] = set()
    waiting: set[tuple[int, int]] = set()
    states = []
    for kind, c, i in order:
        if kind == "F":
            held.add((c, i))
        elif kind == "B":
            waiting.add((c, i))
        else:  # BW, W
            held.discard((c, i))
            waiting.discard((c, i))
        states.append(InFlight(len(held), sum(c == last_chunk for c, _ in held), len(waiting)))
    return states


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_what_each_rank_holds_is_what_the_orders_hold(schedule, p, m, v):
    predicted = in_flight(schedule, p, m, v)
    for r, order in enumerate(_orders(schedule, p, m, v)):
        states = _walk(order, p * v - 1)
        peak = InFlight(*(max(getattr(s, f) for s in states) for f in ("chunks", "heads", "deferred")))
        assert predicted[r] == peak, (r, predicted[r], peak)
        assert peak in states  # reached at once: the peak bytes are the sum


def test_in_flight_against_the_published_counts():
    for p in (2, 4, 8):
        for v in (2, 4):
            # Megatron-LM's interleaved warm-up: rank 0 holds p + (p - 1)/v stages' worth once m >= 2p.
            assert in_flight("interleaved_1f1b", p, 4 * p, v)[0].chunks / v == pytest.approx(p + (p - 1) / v)
        # 1F1B and ZB-H1: p micro-batches on the first rank; GPipe: all of them.
        assert in_flight("1f1b", p, 16)[0].chunks == in_flight("zb_h1", p, 16)[0].chunks == p
        assert in_flight("gpipe", p, 16)[0].chunks == 16


def test_deferred_bytes_are_what_split_backward_keeps():
    # A middle chunk (its input needs a gradient) of a transformers Llama, fp32: B runs, and the gradients kept
    # for W are counted, each storage once.
    from transformers import LlamaConfig, LlamaForCausalLM

    from phalanx.strategies.pipeline.split_backward import backward_inputs

    config = LlamaConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=352,
        vocab_size=500, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    llama = LlamaForCausalLM(config)
    shape = shape_of(llama, "llama", config)
    ids = torch.randint(0, 500, (2, 32))
    # fp32, then bf16 autocast over the fp32 model (matmul outputs in bf16, the norms' in fp32).
    for autocast, act_bytes in ((False, 4), (True, 2)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            embeds = llama.get_input_embeddings()(ids).detach().requires_grad_()
            loss = llama(inputs_embeds=embeds, labels=ids).loss
        _, weights = backward_inputs([loss], [None], [embeds], list(llama.parameters()))
        kept = {
            g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
            for grads in weights.kept.values()
            for g in grads
            if g is not None
        }
        predicted = deferred_bytes(shape, 2, 32, act_bytes=act_bytes, residual_bytes=4)
        assert sum(kept.values()) == pytest.approx(predicted, rel=0.02), autocast
        llama.zero_grad(set_to_none=True)
        weights.run()  # W runs with what was kept
        assert all(p.grad is not None for n, p in llama.named_parameters() if "embed" not in n)


def _llama_8b():
    return load_shape(str(LLAMA3_8B))


def test_each_layout_under_each_schedule():
    shape = _llama_8b()
    world, work = World(8, device_bytes=80 * 10**9), Workload(seq_len=8192)
    one = estimate(shape, world, work, Layout("zero1", pp=4))
    inter = estimate(shape, world, work, Layout("zero1", pp=4, schedule="interleaved_1f1b", virtual_stages=2))
    zb = estimate(shape, world, work, Layout("zero1", pp=4, schedule="zb_h1"))
    m = 4  # one micro-batch a data-parallel rank's share: the same global batch
    assert one.micro_batches == inter.micro_batches == zb.micro_batches == m
    assert (one.bubble, inter.bubble, zb.bubble) == pytest.approx((3 / 7, 3 / 11, 3 / 15))
    # The model states do not depend on the schedule (32 layers: 8 a rank either way).
    assert (inter.params, inter.grads, inter.optimizer) == pytest.approx((one.params, one.grads, one.optimizer))
    # Interleaving holds more of the first rank's layers at once and sends 2v instead of 2 messages a micro-batch;
    # zb_h1 sends what 1f1b sends, and its last rank holds p heads and the gradients W waits for.
    for policy in ("selective", "full"):
        assert one.activations[policy] < inter.activations[policy] < zb.activations[policy]
    tokens_act = 8192 * 4096 * 2
    assert inter.sent - one.sent == pytest.approx(m * 2 * tokens_act)
    assert zb.sent == one.sent
    assert inter.layout.settings() == {"strategy": "pipeline", "pp_size": 4, "pp_zero_stage": 1,
                                       "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}  # fmt: skip
    assert (one.layout.name, inter.layout.name, zb.layout.name) == (
        "pp4 zero1", "pp4 zero1 interleaved_1f1b v2", "pp4 zero1 zb_h1"
    )  # fmt: skip


def test_the_recommendation_considers_the_schedules(capsys):
    shape = _llama_8b()
    world, work = World(8, device_bytes=80 * 10**9), Workload(seq_len=8192)
    # Under 1F1B every pipeline idles a third of the step or more: none is recommended, zero2 is.
    only = plan(shape, world, work, ("1f1b",))
    assert recommend(only).layout.name == "zero2"  # type: ignore[union-attr]
    # Interleaved, pp2 idles 1/5 and sends less than half of zero2's bytes.
    best = recommend(plan(shape, world, work))
    assert best is not None and best.layout.name == "pp2 zero1 interleaved_1f1b v2" and best.bubble == 0.2
    code = main(["plan", "--model", str(LLAMA3_8B), "-n", "8", "--device-memory", "80GB", "--seq-len", "8192",
                 "--json"])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["recommended"] == "pp2 zero1 interleaved_1f1b v2"
    assert report["recommended_settings"]["pp_schedule"] == "interleaved_1f1b"
    # With --pp-virtual-stages 4: pp x 4 chunks of a layer or more; pp8 makes 32 chunks of one layer each.
    code = main(["plan", "--model", str(LLAMA3_8B), "-n", "8", "--pp-schedule", "interleaved_1f1b",
                 "--pp-virtual-stages", "4", "--json"])  # fmt: skip
    layouts = {e["layout"]: e for e in json.loads(capsys.readouterr().out)["layouts"]}
    assert code == 0
    pipes = sorted(n for n in layouts if n.startswith("pp"))
    assert pipes == ["pp2 zero1 interleaved_1f1b v4", "pp4 zero1 interleaved_1f1b v4", "pp8 zero1 interleaved_1f1b v4"]
    assert layouts["pp8 zero1 interleaved_1f1b v4"]["bubble"] == pytest.approx(7 / (4 * 8 + 7), abs=1e-4)


def test_bad_schedules_are_refused(capsys):
    for args, message in [
        (("--pp-schedule", "interleaved"), "invalid choice: 'interleaved'"),
        (("--pp-schedule", "zb_h1", "--pp-virtual-stages", "2"), "--pp-virtual-stages 2 applies to"),
        (("--pp-virtual-stages", "1"), "needs 2 or more chunks a rank"),
        (("--max-bubble", "25"), "--max-bubble 25.0: a share of the step"),
    ]:
        try:
            code = main(["plan", "--model", str(LLAMA3_8B), "-n", "8", *args])
        except SystemExit as e:  # argparse's own refusal
            code = int(e.code or 0)
        err = capsys.readouterr().err
        assert code == 2 and message in err, (args, err)
    shape = _llama_8b()
    with pytest.raises(PlanError, match="need a layer each, and the model has 32"):
        estimate(shape, World(8), Workload(), Layout("zero1", pp=8, schedule="interleaved_1f1b", virtual_stages=8))
    with pytest.raises(PlanError, match="multiple of 4"):
        bubble("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(PlanError, match="pp_virtual_stages=2 applies to pp_schedule='interleaved_1f1b' only"):
        bubble("zb_h1", 4, 8, 2)
    with pytest.raises(PlanError, match="interleaved_1f1b takes 2 or more chunks"):
        Layout("zero1", pp=2, schedule="interleaved_1f1b")
    with pytest.raises(PlanError, match="pp_schedule='zb'"):
        Layout("zero1", pp=2, schedule="zb")


def test_a_pipeline_whose_traffic_is_unknown_is_not_recommended():
    # An MLP: no decoder widths, so a pipeline's activations and messages are not counted; under zb_h1 it would
    # idle 1/7 of the step and seem to send nothing.
    from torch import nn

    shape = shape_of(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)), "mlp")
    estimates = {e.layout.name: e for e in plan(shape, World(2, device_bytes=10**9), Workload())}
    zb = estimates["pp2 zero1 zb_h1"]
    assert zb.fits and not zb.counted and zb.bubble == pytest.approx(1 / 7) and zb.sent == 0
    assert estimates["zero1"].counted and recommend(list(estimates.values())).layout.name == "zero1"  # type: ignore[union-attr]
