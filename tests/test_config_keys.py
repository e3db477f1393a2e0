"""The table of DeepSpeed and Accelerate keys (docs/config-keys.md) is what the dialect code does, and lists every key
that code reads: a key handled in the code but missing from the table fails here, and so does the reverse."""

from __future__ import annotations

import ast
import io
from pathlib import Path

import pytest

from phalanx.config.dialects import accelerate as acc
from phalanx.config.dialects import deepspeed as ds
from phalanx.config.dialects import keys
from phalanx.config.options import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _rendered() -> str:
    buffer = io.StringIO()
    keys.render(lambda line: print(line, file=buffer))
    return buffer.getvalue()


def test_the_committed_page_is_what_the_code_generates():
    page = (ROOT / "docs" / "config-keys.md").read_text()
    assert page == _rendered(), (
        "docs/config-keys.md is stale: regenerate it with python -m phalanx.config.dialects.keys > docs/config-keys.md"
    )


@pytest.mark.parametrize("dialect, module", [("deepspeed", ds), ("accelerate", acc)])
def test_every_section_the_code_reads_has_a_probe_for_each_of_its_keys_and_no_more(dialect, module):
    sections = {s.name: s for s in keys.SECTIONS if s.dialect == dialect}
    assert set(sections) == set(module.KNOWN_KEYS), "a section of KNOWN_KEYS has no table, or the reverse"
    for name, section in sections.items():
        probed, known = set(section.probes), set(module.KNOWN_KEYS[name])
        assert probed - known == set(), f"{dialect} {name!r}: in the table but not read by the code"
        assert known - probed == set(), f"{dialect} {name!r}: read by the code but missing from the table"


def _keys_compared_in(path: Path) -> set[str]:
    """The string constants the module compares a variable named ``key`` with (``key == "x"``, ``key in (...)``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "key":
            for right in node.comparators:
                for leaf in ast.walk(right):
                    if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str):
                        found.add(leaf.value)
    return found


@pytest.mark.parametrize("module", [ds, acc])
def test_a_key_the_code_branches_on_is_declared_in_known_keys(module):
    declared = set().union(*module.KNOWN_KEYS.values())
    compared = _keys_compared_in(Path(module.__file__))
    assert compared, "the scan found no comparisons at all: it is not looking at the right code"
    assert compared - declared == set(), "handled in a branch but missing from KNOWN_KEYS (and so from the table)"


def test_no_known_key_is_called_unknown_and_none_is_accepted_silently():
    rows = list(keys.rows())
    assert len(rows) > 200
    for row in rows:
        where = f"{row.section.title} {row.key}={row.value!r}"
        assert "unknown key" not in row.outcome and "did you mean" not in row.outcome, where
        assert row.kind in ("maps", "ignores", "refuses", "default"), f"{where}: {row.outcome}"
    by_key: dict[tuple[str, str], set[str]] = {}
    for row in rows:
        by_key.setdefault((row.section.title, row.key), set()).add(row.kind)
    silent = [k for k, kinds in by_key.items() if kinds == {"default"}]
    assert silent == [], f"keys whose every probe changes nothing: {silent}"


def test_a_key_outside_the_table_is_still_refused_as_unknown():
    with pytest.raises(ConfigError, match="unknown key 'zero_optimization.stag'"):
        ds.from_deepspeed({"zero_optimization": {"stag": 2}}, "x.json")
    with pytest.raises(ConfigError, match="unknown key 'fsdp_config.fsdp_shard'"):
        acc.from_accelerate({"distributed_type": "FSDP", "fsdp_config": {"fsdp_shard": 1}}, "x.yaml", dict)


def _row(title_part: str, key: str, value):
    for row in keys.rows():
        if title_part in row.section.title and row.key == key and row.value == value:
            return row
    raise AssertionError(f"no row for {key}={value!r}")


def test_the_rows_say_what_the_issue_asked_for():
    # A feature phalanx lacks is named as DeepSpeed names it, never as a typo.
    row = _row("DeepSpeed JSON: top", "hybrid_engine", {"enabled": True})
    assert row.kind == "refuses" and "the Hybrid Engine for RLHF generation (hybrid_engine)" in row.outcome
    # AutoEP's size is the mesh's ep_size, with what differs from AutoEP.
    row = _row("DeepSpeed JSON: top", "expert_parallel", {"enabled": True, "autoep_size": 2})
    assert row.kind == "maps" and "`ep_size` = `2`" in row.outcome and "base_model_ep_plan" in row.outcome
    # AutoTP's size is the mesh's tp_size, and hpZ's group is hybrid zero3's shard group, each with what differs.
    row = _row("DeepSpeed JSON: top", "tensor_parallel", {"autotp_size": 2})
    assert row.kind == "maps" and "`tp_size` = `2`" in row.outcome and "the model's own plan" in row.outcome
    row = _row("zero_optimization", "zero_hpz_partition_size", 8)
    assert row.kind == "maps" and "`dp_shard_size` = `8`" in row.outcome and "the memory is not" in row.outcome
    # Accelerate's ParallelismConfig sizes are the mesh's: cp_size is ring attention, sp_size Ulysses (and DeepSpeed's
    # sequence_parallel_size too); the options are mapped, noted or refused with the reason.
    assert "`dp_replicate_size` = `2`" in _row("parallelism_config", "parallelism_config_dp_replicate_size", 2).outcome
    assert _row("parallelism_config", "parallelism_config_cp_size", 8).outcome == "sets `cp_size` = `8`"
    assert _row("parallelism_config", "parallelism_config_sp_size", 2).outcome == "sets `sp_size` = `2`"
    row = _row("parallelism_config", "parallelism_config_cp_comm_strategy", "alltoall")
    assert row.kind == "ignores" and "note:" in row.outcome and "point-to-point" in row.outcome
    row = _row("parallelism_config", "parallelism_config_sp_backend", "megatron")
    assert row.kind == "refuses" and "only sequence-parallel backend is 'deepspeed'" in row.outcome
    row = _row("parallelism_config", "parallelism_config_cp_backend", "deepspeed")
    assert row.kind == "refuses" and "Accelerate 1.11's ALST spelling" in row.outcome
    assert "sets `sp_size` = `4`" in _row("DeepSpeed JSON: top", "sequence_parallel_size", 4).outcome
    # "auto" is filled as Accelerate fills it.
    assert "`strategy` = `'zero2'`" in _row("zero_optimization", "stage", "auto").outcome
    assert "`max_grad_norm` = `1.0` unless" in _row("DeepSpeed JSON: top", "gradient_clipping", "auto").outcome
    # A SageMaker config is refused, naming SageMaker.
    row = _row("Accelerate YAML: top", "compute_environment", "AMAZON_SAGEMAKER")
    assert row.kind == "refuses" and "SageMaker" in row.outcome
    # Accelerate's debug mode is phalanx's collective checks.
    assert "`debug_collectives` = `True`" in _row("Accelerate YAML: top", "debug", True).outcome


def test_an_auto_clipping_is_filled_unless_another_layer_says_it(tmp_path, monkeypatch):
    from phalanx.config.settings import resolve_config

    monkeypatch.delenv("ACCELERATE_GRADIENT_CLIPPING", raising=False)
    path = tmp_path / "ds.json"
    path.write_text('{"gradient_clipping": "auto", "zero_optimization": {"stage": 2}}')
    filled = resolve_config(file=path, env={})
    assert filled.engine.max_grad_norm == 1.0 and '"auto"' in filled.origins["max_grad_norm"]
    # An argument (the HF Trainer passes its max_grad_norm) wins, with no complaint about the file.
    given = resolve_config(file=path, env={}, cli={"max_grad_norm": 0.5}, cli_origin="argument")
    assert given.engine.max_grad_norm == 0.5 and given.overrides == []
    monkeypatch.setenv("ACCELERATE_GRADIENT_CLIPPING", "2.5")
    assert resolve_config(file=path, env={}).engine.max_grad_norm == 2.5
