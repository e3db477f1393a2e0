"""cp_size (ring attention) and sp_size (Ulysses, DeepSpeed's ALST) through every front: Accelerate's YAML and
launcher flags, phalanx's own flags, DeepSpeed's JSON, ``TrainingArguments`` and ``Accelerator`` with Accelerate's
or phalanx's ``ParallelismConfig``, and the Trainer. One reader (``config/dialects/parallelism.py``) maps, notes or
refuses each of ParallelismConfig's settings, so the same value gets the same answer, spelt as the front spells it.

The runs on two ranks train a tiny transformers Llama (fp32, no dropout) and must match one process within 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx.config.mesh import Mesh, MeshError
from phalanx.config.options import ConfigError
from phalanx.config.settings import resolve_config

DATA = Path(__file__).parent / "data" / "accelerate"
STEPS, BATCH, SEQ, VOCAB = 2, 4, 16, 64
TOL = 1e-5


def _ignored(cfg: Any) -> dict[str, str]:
    return {key.split(": ", 1)[1]: why for key, why in cfg.ignored}


# ----------------------------------------------------------------------------------- Accelerate's YAML: shipped configs
def test_trl_context_parallel_2gpu_is_ring_attention_on_two_ranks():
    cfg = resolve_config(file=DATA / "trl_context_parallel_2gpu.yaml", env={})
    e = cfg.engine
    assert (e.strategy, e.precision, e.cp_size, e.sp_size) == ("zero3", "bf16-mixed", 2, 1)
    assert (e.tp_size, e.dp_shard_size, e.dp_replicate_size, cfg.launch.nproc_per_node) == (1, 1, 1, 2)
    assert cfg.origins["cp_size"].endswith("(accelerate parallelism_config.parallelism_config_cp_size)")
    assert "fsdp_reshard_after_forward" in cfg.origins["strategy"]
    mesh = Mesh.of(e, 2, cfg.origins)
    assert (mesh.sizes, mesh.cp_kind) == ((1, 1, 1, 2, 1), "ring")


def test_trl_alst_ulysses_4gpu_is_ulysses_over_two_ranks_and_zero3_over_two_shards():
    cfg = resolve_config(file=DATA / "trl_alst_ulysses_4gpu.yaml", env={})
    e = cfg.engine
    assert (e.strategy, e.sp_size, e.cp_size, e.dp_shard_size, cfg.launch.nproc_per_node) == ("zero3", 2, 1, 2, 4)
    assert cfg.origins["sp_size"].endswith("(accelerate parallelism_config.parallelism_config_sp_size)")
    ignored = _ignored(cfg)
    assert "ALST/Ulysses" in ignored["parallelism_config.parallelism_config_sp_backend"]
    assert "any length" in ignored["parallelism_config.parallelism_config_sp_seq_length_is_variable"]
    assert "SDPA in its place" in ignored["parallelism_config.parallelism_config_sp_attn_implementation"]
    assert "own dtype" in ignored["deepspeed_config.seq_parallel_communication_data_type"]
    # flash_attention_2 is run as SDPA: the same values, said in a note with what packing would need
    assert any("in place of flash_attention_2" in n and "pad the documents apart" in n for n in cfg.notes)
    mesh = Mesh.of(e, 4, cfg.origins)
    assert (mesh.sizes, mesh.cp_kind, mesh.sp) == ((1, 1, 2, 2, 1), "ulysses", 2)


def test_the_alst_config_in_accelerate_1_11_spelling_is_refused_with_today_s_names(tmp_path):
    text = (DATA / "trl_alst_ulysses_4gpu.yaml").read_text()
    old = text.replace("parallelism_config_sp_", "parallelism_config_cp_")  # TRL's first version of the file
    path = tmp_path / "old.yaml"
    path.write_text(old)
    with pytest.raises(ConfigError, match=r"Accelerate 1\.11's ALST spelling.*sp_backend: deepspeed"):
        resolve_config(file=path, env={})


def test_accelerate_s_cp_example_maps_with_its_activation_checkpointing():
    cfg = resolve_config(file=DATA / "accelerate_cp.yaml", env={})
    assert (cfg.engine.strategy, cfg.engine.cp_size, cfg.engine.activation_checkpointing) == ("zero3", 8, "full")
    assert Mesh.of(cfg.engine, 8, cfg.origins).sizes == (1, 1, 1, 8, 1)


def test_phalanx_config_prints_what_each_key_became_and_the_mesh(capsys):
    from phalanx.launch.cli import main

    assert main(["config", "--config", str(DATA / "trl_alst_ulysses_4gpu.yaml")]) == 0
    out = capsys.readouterr().out
    assert "parallelism_config.parallelism_config_sp_size" in out and "cp by Ulysses (sp)" in out
    assert "# note: parallelism_config.parallelism_config_sp_attn_implementation='flash_attention_2'" in out


@pytest.mark.parametrize(
    "options, match",
    [
        ({"parallelism_config_cp_comm_strategy": "alltoall", "parallelism_config_cp_size": 2}, None),
        ({"parallelism_config_cp_size": 2, "parallelism_config_sp_size": 2}, "both split the sequence"),
        ({"parallelism_config_sp_size": 2, "parallelism_config_sp_backend": "torch"}, "only sequence-parallel"),
        ({"parallelism_config_cp_size": 2, "parallelism_config_cp_backend": "deepspeed"}, "only context-parallel"),
        ({"parallelism_config_sp_size": 2, "parallelism_config_sp_attn_implementation": "eager"}, "write 'sdpa'"),
    ],
)
def test_the_yaml_s_sequence_split_options(tmp_path, options, match):
    path = tmp_path / "a.yaml"
    path.write_text(f"distributed_type: MULTI_GPU\nnum_processes: 2\nparallelism_config: {json.dumps(options)}\n")
    if match is not None:
        with pytest.raises(ConfigError, match=rf"accelerate config: parallelism_config\.parallelism_config_.*{match}"):
            resolve_config(file=path, env={})
        return
    cfg = resolve_config(file=path, env={})
    assert cfg.engine.cp_size == 2
    assert any("point-to-point" in n and "'alltoall'" in n for n in cfg.notes)


# --------------------------------------------------------------------------------------------- DeepSpeed's JSON
def test_deepspeed_sequence_parallel_size_is_sp_size(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"sequence_parallel_size": 4, "zero_optimization": {"stage": 3}}))
    cfg = resolve_config(file=path, env={})
    assert (cfg.engine.sp_size, cfg.engine.strategy) == (4, "zero3")
    assert "(deepspeed sequence_parallel_size)" in cfg.origins["sp_size"]
    assert any("UlyssesSPDataLoaderAdapter" in n for n in cfg.notes)
    assert Mesh.of(cfg.engine, 8, cfg.origins).sizes == (1, 1, 2, 4, 1)
    # Named in an Accelerate YAML with another sp_size, it disagrees with it, naming both.
    yaml = tmp_path / "a.yaml"
    yaml.write_text(
        f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {path}\n"
        "parallelism_config:\n  parallelism_config_sp_size: 2\n"
    )
    with pytest.raises(ConfigError, match=r"sp_size=4 .*sequence_parallel_size.*disagrees with sp_size=2"):
        resolve_config(file=yaml, env={})


# ------------------------------------------------------------------------------------------------------ the flags
def test_phalanx_s_and_accelerate_s_flags(capsys):
    from phalanx.launch.cli import main

    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--cp-size", "--sp-size", "--parallelism_config_cp_size", "--parallelism_config_cp_comm_strategy",
                 "--parallelism_config_sp_backend", "--parallelism_config_sp_attn_implementation"):  # fmt: skip
        assert flag in help_text, flag
    assert main(["config", "--cp-size", "2", "-n", "4"]) == 0
    out = capsys.readouterr().out
    assert "mesh (pp=1, dp_replicate=2, dp_shard=1, cp=2, tp=1) on 4 ranks" in out and "ring attention" in out
    flags = ["--parallelism_config_sp_size", "2", "--parallelism_config_sp_attn_implementation", "flash_attention_2"]
    assert main(["config", "-n", "2", *flags]) == 0
    out = capsys.readouterr().out
    assert "cp by Ulysses (sp)" in out and "# note: --parallelism_config_sp_attn_implementation=" in out


def test_cp_from_a_file_and_sp_from_a_flag_are_refused_naming_the_file_key(capsys):
    from phalanx.launch.cli import main

    assert main(["config", "--config", str(DATA / "trl_context_parallel_2gpu.yaml"), "--sp-size", "2"]) != 0
    err = capsys.readouterr().err
    assert "both split the sequence" in err and "sp_size=2 (cli)" in err
    assert "cp_size=2 (" in err and "parallelism_config.parallelism_config_cp_size))" in err


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--cp-size", "2", "--parallelism_config_sp_size", "2"], "--cp-size=2 and --parallelism_config_sp_size=2"),
        (
            ["--sp-size", "2", "--parallelism_config_sp_backend", "megatron"],
            "--parallelism_config_sp_backend='megatron'",
        ),
        (["--cp-size", "2", "--parallelism_config_cp_size", "4"], "both set cp_size, to different values"),
    ],
)
def test_flags_that_cannot_be_honoured_name_the_flags(capsys, flags, match):
    from phalanx.launch.cli import main

    assert main(["config", "-n", "4", *flags]) != 0
    assert match in capsys.readouterr().err


# ------------------------------------------------------------------------- ParallelismConfig objects and dicts
def test_one_reader_for_every_parallelism_config_front():
    from accelerate.parallelism_config import ParallelismConfig as AcceleratePC
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig as AccelerateSP

    from phalanx.accelerate import Accelerator
    from phalanx.accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig
    from phalanx.compat.accelerate.utils import parallelism_options

    notes: list[str] = []
    assert parallelism_options(ParallelismConfig(cp_size=2), notes) == {"cp_size": 2}
    assert notes == []
    # Accelerate's object fills every size (1) and the cp handler's strategy ('allgather'): noted, not silent.
    assert parallelism_options(AcceleratePC(cp_size=2), notes) == {
        "dp_replicate_size": 1, "dp_shard_size": 1, "tp_size": 1, "cp_size": 2,
    }  # fmt: skip
    assert len(notes) == 1 and "ParallelismConfig.cp_handler.cp_comm_strategy='allgather'" in notes[0]
    alst = AcceleratePC(sp_size=2, sp_handler=AccelerateSP(sp_seq_length=256, sp_attn_implementation="sdpa"))
    assert parallelism_options(alst)["sp_size"] == 2
    ours = ParallelismConfig(sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="eager"))
    with pytest.raises(ConfigError, match=r"ParallelismConfig\.sp_handler\.sp_attn_implementation='eager'"):
        parallelism_options(ours)
    with pytest.raises(ConfigError, match=r"ParallelismConfig\.cp_size=2 and ParallelismConfig\.sp_size=2 both"):
        parallelism_options(ParallelismConfig(cp_size=2, sp_size=2))
    with pytest.raises(ConfigError, match=r"ParallelismConfig\.sp_backend='torch'.*only sequence-parallel backend"):
        Accelerator(parallelism_config=ParallelismConfig(sp_size=2, sp_backend="torch"))


def test_training_arguments_take_cp_and_sp_from_parallelism_config(tmp_path):
    from accelerate.parallelism_config import ParallelismConfig as AcceleratePC

    from phalanx.accelerate.utils import ParallelismConfig

    args = phalanx.TrainingArguments(str(tmp_path), parallelism_config={"cp_size": 2, "cp_comm_strategy": "alltoall"})
    assert args.engine_options()["cp_size"] == 2 and "sp_size" not in args.engine_options()
    assert args.parallelism_config == {"cp_size": 2, "cp_comm_strategy": "alltoall"}  # JSON, as given
    json.dumps(args.to_dict())
    args = phalanx.TrainingArguments(str(tmp_path), parallelism_config=AcceleratePC(sp_size=2, dp_shard_size=2))
    assert (args.engine_options()["sp_size"], args.dp_shard_size) == (2, 2)
    args = phalanx.TrainingArguments(str(tmp_path), parallelism_config=ParallelismConfig(sp_size=4))
    assert args.engine_options()["sp_size"] == 4
    with pytest.raises(ConfigError, match=r"parallelism_config\['cp_size'\]=2 and parallelism_config\['sp_size'\]=4"):
        phalanx.TrainingArguments(str(tmp_path), parallelism_config={"cp_size": 2, "sp_size": 4})
    with pytest.raises(ConfigError, match=r"strategy_options\['sp_size'\] is set by .*parallelism_config"):
        phalanx.TrainingArguments(str(tmp_path), strategy_options={"sp_size": 2})
    # The Engine's mesh check names the setting and where it came from (here: the TrainingArguments' argument).
    with pytest.raises(MeshError, match=r"cp_size=2 \(argument\)"):
        phalanx.Engine(**phalanx.TrainingArguments(str(tmp_path), parallelism_config={"cp_size": 2}).engine_options())


# ----------------------------------------------------------------------------------------- models and data
def llama(seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0, attn_implementation="sdpa",
        use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def samples(n: int = STEPS * BATCH) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        mask = torch.ones(SEQ, dtype=torch.long)
        if i % BATCH == 1:  # right padding in one row of each batch
            mask[-5:] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def _state(engine: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.get_state_dict(model).items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=TOL, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


# ------------------------------------------------------------------------------- Accelerator: the explicit form
def _own_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    shift = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    return ids, shift


def _accelerate_loop(cp: int) -> dict[str, Any]:
    from phalanx.accelerate import Accelerator
    from phalanx.accelerate.utils import ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(cp_size=cp) if cp > 1 else None)
    model = llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = torch.utils.data.DataLoader(samples(), batch_size=BATCH)
    model, opt, loader = acc.prepare(model, opt, loader)
    for batch in loader:  # Accelerate's examples/torch_native_parallelism/nd_parallel.py, line for line
        batch["position_ids"] = torch.arange(0, batch["input_ids"].size(1)).unsqueeze(0)
        buffers = [
            batch["input_ids"],
            batch.get("shift_labels", batch["labels"]),
            batch["labels"],
            batch["position_ids"],
        ]
        with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1, 1], no_restore_buffers=set(buffers)):
            loss = model(**batch).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
    # Tensors the script made itself, whole: cut for the block, and restored after it.
    ids, shift = _own_batch()
    positions = torch.arange(SEQ).expand(2, -1)
    with acc.maybe_context_parallel(buffers=[ids, shift, positions], buffer_seq_dims=[1, 1, 1]):
        held = ids.shape[1]
        out = model(input_ids=ids, labels=shift, shift_labels=shift, position_ids=positions)
        n = (shift != -100).sum()
        acc.backward(out.loss * n, items=n)
        opt.step()
        opt.zero_grad()
    return {"state": _state(acc, model), "held": held, "after": ids.shape[1]}


def test_accelerator_maybe_context_parallel_matches_one_process(run_ranks):
    one = _accelerate_loop(1)
    assert (one["held"], one["after"]) == (SEQ, SEQ)  # without cp: a no-op
    for r in run_ranks(_accelerate_loop, 2, 2):
        assert (r["held"], r["after"]) == (SEQ // 2, SEQ)
        _same(r["state"], one["state"])


def test_maybe_context_parallel_without_cp_warns_once_and_does_nothing(monkeypatch):
    import phalanx.compat.accelerate.accelerator as front

    said: list[str] = []
    monkeypatch.setattr(front, "warn_once", said.append)
    acc = front.Accelerator()
    x = torch.arange(8.0).view(1, 8)
    with acc.maybe_context_parallel(buffers=[x], buffer_seq_dims=[1]):
        assert x.shape == (1, 8)
    assert len(said) == 1 and "context parallelism is not enabled" in said[0]


# ---------------------------------------------------------------------------------------------- the Trainer
def _loss_with_shift(outputs: Any, labels: Any, num_items_in_batch: Any = None, shift_labels: Any = None) -> Any:
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(outputs.logits, labels, VOCAB, shift_labels=shift_labels)


def _trainer_run(tmp: str, variant: str, pc: dict[str, int] | None) -> dict[str, Any]:
    extra: dict[str, Any] = {"label_smoothing_factor": 0.1} if variant == "smoothing" else {}
    args = phalanx.TrainingArguments(
        tmp, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH, max_steps=STEPS, learning_rate=0.5,
        optim="sgd", lr_scheduler_type="constant", max_grad_norm=0, save_strategy="no", report_to=[],
        disable_tqdm=True, logging_steps=1, seed=0, parallelism_config=pc, **extra,
    )  # fmt: skip
    loss_func = _loss_with_shift if variant == "loss_func" else None
    data = samples()
    trainer = phalanx.Trainer(llama(), args, train_dataset=data, eval_dataset=data, compute_loss_func=loss_func)
    trainer.train()
    steps = [
        trainer.prediction_step(trainer.model, batch, False)
        for batch in trainer.engine.prepare(trainer.get_eval_dataloader())
    ]
    out = trainer.predict(data)
    result = {"state": _state(trainer.engine, trainer.model), "loss": out.metrics["test_loss"], "steps": steps}
    result["rows"] = out.predictions.shape[0]
    if variant == "loss_func" and pc is not None:  # a compute_loss_func that would shift a chunk is refused
        bad = phalanx.Trainer(llama(), args, train_dataset=data, compute_loss_func=lambda o, labels, **kw: o.loss)
        try:
            bad.train()
            result["refused"] = "no error"
        except ValueError as e:
            result["refused"] = str(e)
    return result


# One spawn for the three: ring attention with the model's own loss, Ulysses with transformers' label smoothing, and
# ring attention with a compute_loss_func that takes shift_labels.
_VARIANTS = [("plain", {"cp_size": 2}), ("smoothing", {"sp_size": 2}), ("loss_func", {"cp_size": 2})]


def _trainer_runs(tmp: str) -> list[dict[str, Any]]:
    return [_trainer_run(f"{tmp}/{variant}", variant, pc) for variant, pc in _VARIANTS]


def test_the_trainer_under_context_parallelism_matches_one_process(run_ranks, tmp_path):
    ones = [_trainer_run(str(tmp_path / f"one-{variant}"), variant, None) for variant, _ in _VARIANTS]
    ranks = run_ranks(_trainer_runs, 2, str(tmp_path / "two"))
    for (variant, _), one, results in zip(_VARIANTS, ones, zip(*ranks), strict=True):
        for r in results:
            _same(r["state"], one["state"])
            assert r["loss"] == pytest.approx(one["loss"], abs=TOL), variant
            # each evaluation batch's loss, logits and labels, put back together in order of position
            for (loss, logits, labels), (loss1, logits1, labels1) in zip(r["steps"], one["steps"], strict=True):
                assert loss.item() == pytest.approx(loss1.item(), abs=TOL), variant
                assert torch.equal(labels, labels1)
                real = labels1 != -100  # a padding query's output is no token's (Ulysses lets it attend itself)
                torch.testing.assert_close(logits[real], logits1[real], atol=TOL, rtol=0)
            if variant == "loss_func":
                assert "compute_loss_func(outputs, labels, num_items_in_batch) would get this rank's" in r["refused"]
                assert "shift_labels keyword" in r["refused"]
    # gather_for_metrics over the data ranks only: the cp ranks' copies of each prediction are not kept twice
    assert all(r["rows"] == len(samples()) for results in ranks for r in results)
