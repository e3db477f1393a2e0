"""Accelerate's ``ParallelismConfig``, read once for every front that takes it.

The same settings arrive four ways: an ``accelerate config`` YAML (``parallelism_config:`` with prefixed keys), the
launcher's ``--parallelism_config_*`` flags, ``Accelerator(parallelism_config=...)`` and
``TrainingArguments(parallelism_config=...)`` (Accelerate's object, phalanx's, or a dict). Each front flattens what
it got into Accelerate's names (:data:`NAMES`) and hands them to :func:`read_parallelism`, with a ``spell`` that
writes a name as that front spells it, so that every message names the key the user wrote.

The sizes are phalanx's mesh settings of the same names (``cp_size`` is ring attention, ``sp_size`` Ulysses). The
options of the two sequence splits are Accelerate's backends and handlers (``TorchContextParallelConfig``,
``DeepSpeedSequenceParallelConfig``); each is taken for what phalanx does, said in a note, or refused with why.

Expert parallelism is not among them: Accelerate 1.15's ParallelismConfig has no expert-parallel size (nor does
transformers' TrainingArguments; transformers' own ``DistributedConfig(ep_size=...)`` is a from_pretrained argument,
not a training one), so there is nothing to map. phalanx's ``ep_size`` is set as its own setting (``--ep-size``, a
phalanx YAML, ``TrainingArguments(ep_size=...)``) or by DeepSpeed's ``expert_parallel.autoep_size``; an ``ep_size``
written into a ParallelismConfig is refused with that pointer (:data:`NOT_ACCELERATE`) rather than taken for a typo
of ``sp_size``.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from phalanx.config.options import ConfigError

__all__ = [
    "SIZES", "OPTIONS", "NAMES", "NOT_ACCELERATE", "Parallelism", "read_parallelism", "values_of", "check_option",
    "object_spelling",
]  # fmt: skip

SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")
"""ParallelismConfig's sizes: phalanx's mesh settings of the same names."""
OPTIONS = (
    "cp_backend", "cp_comm_strategy", "sp_backend", "sp_seq_length", "sp_seq_length_is_variable",
    "sp_attn_implementation",
)  # fmt: skip
"""The options of the two sequence splits (ParallelismConfig's backends and its handlers' fields)."""
NAMES = SIZES + OPTIONS
NOT_ACCELERATE = {
    "ep_size": "Accelerate's ParallelismConfig has no expert-parallel size; set phalanx's ep_size instead (--ep-size, "
    "ep_size in a phalanx YAML, TrainingArguments(ep_size=...), or DeepSpeed's expert_parallel.autoep_size)",
}
"""Sizes that phalanx has and ParallelismConfig does not, and where to set them."""

_CP_OPTIONS = ("cp_backend", "cp_comm_strategy")
_SP_OPTIONS = ("sp_backend", "sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation")
_COMM_STRATEGIES = ("allgather", "alltoall")
_FLASH = ("flash_attention_2", "flash_attention_3")


@dataclass
class Parallelism:
    """What a ParallelismConfig asks of phalanx.

    ``sizes`` holds every size given (1 included); :meth:`settings` the Engine settings they make. ``accepted`` says,
    for each option (and each cp or sp size of 1) that sets nothing, what phalanx does with it; ``notes`` say where
    phalanx does the job its own way."""

    sizes: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def settings(self) -> dict[str, int]:
        """The Engine settings: the data and tensor sizes as given, cp_size and sp_size when above 1."""
        return {k: v for k, v in self.sizes.items() if k not in ("cp_size", "sp_size") or v > 1}

    @property
    def asks_for_a_mesh(self) -> bool:
        """Any size above 1 (Accelerate's all-ones config asks for nothing beyond the strategy's own layout)."""
        return any(v > 1 for v in self.sizes.values())


def values_of(config: Any, who: str = "parallelism_config") -> dict[str, Any]:
    """Accelerate's names and values in ``config``: a dict of them, Accelerate's ``ParallelismConfig`` (its handlers'
    fields included) or phalanx's. Unset (None) values are left out; a dict's unknown key is refused."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        unknown = sorted(set(config) - set(NAMES))
        for key in unknown:
            if key in NOT_ACCELERATE:
                raise ConfigError(f"{who}[{key!r}]: {NOT_ACCELERATE[key]}")
        if unknown:
            close = difflib.get_close_matches(str(unknown[0]), NAMES, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"{who}: unknown key {unknown[0]!r}; {hint}ParallelismConfig's settings are {', '.join(NAMES)}"
            )
        return {k: v for k, v in config.items() if v is not None}
    if not any(hasattr(config, k) for k in SIZES):
        raise ConfigError(
            f"{who} takes Accelerate's ParallelismConfig (or phalanx.accelerate.utils.ParallelismConfig), or a dict of "
            f"its settings such as {{'cp_size': 2}}; got a {type(config).__name__}"
        )
    out = {k: getattr(config, k, None) for k in (*SIZES, "cp_backend", "sp_backend")}
    for handler, names in (("cp_handler", ("cp_comm_strategy",)), ("sp_handler", _SP_OPTIONS[1:])):
        obj = getattr(config, handler, None)
        for name in names:
            out[name] = getattr(obj, name, None) if obj is not None else getattr(config, name, None)
    return {k: v for k, v in out.items() if v is not None}


def object_spelling(name: str) -> Callable[[str], str]:
    """How a ParallelismConfig object named ``name`` spells each setting: ``ParallelismConfig.cp_size``, and the
    handlers' fields under their handler (``ParallelismConfig.sp_handler.sp_attn_implementation``)."""

    def spell(key: str) -> str:
        if key == "cp_comm_strategy":
            return f"{name}.cp_handler.{key}"
        if key in _SP_OPTIONS[1:]:
            return f"{name}.sp_handler.{key}"
        return f"{name}.{key}"

    return spell


def _size(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a whole number of at least 1; got {value!r}")
    return value


def _flag(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "1"):
        return True
    if text in ("false", "no", "0"):
        return False
    raise ConfigError(f"{name} is true or false; got {value!r}")


def check_option(key: str, value: Any, spell: Callable[[str], str] = str) -> Any:
    """``value`` of the option ``key`` as phalanx reads it, or the refusal of a value that no size makes right
    (Accelerate refuses the same values when it builds its ParallelismConfig)."""
    name = spell(key)
    text = str(value).strip()
    if key == "cp_backend" and text != "torch":
        hint = (
            " (Accelerate 1.11's ALST spelling: ALST/Ulysses is now sp_backend: deepspeed with sp_size, which is "
            "phalanx's sp_size)"
            if text == "deepspeed"
            else ""
        )
        raise ConfigError(
            f"{name}={value!r}: Accelerate's only context-parallel backend is 'torch' (torch's context_parallel under "
            f"FSDP2), for which phalanx's ring attention stands in{hint}; write 'torch' or leave it out"
        )
    if key == "sp_backend" and text != "deepspeed":
        raise ConfigError(
            f"{name}={value!r}: Accelerate's only sequence-parallel backend is 'deepspeed' (DeepSpeed's ALST/Ulysses), "
            "which is what phalanx's sp_size does (all-to-alls between a sequence split and a head split); write "
            "'deepspeed' or leave it out"
        )
    if key == "cp_comm_strategy" and text not in _COMM_STRATEGIES:
        raise ConfigError(f"{name}={value!r}: Accelerate's strategies are 'allgather' and 'alltoall'")
    if key == "sp_seq_length":
        if text.lower() == "none":
            return None
        try:
            length = int(text)
        except ValueError:
            length = 0
        if isinstance(value, bool) or length < 1:
            raise ConfigError(f"{name} is a number of tokens; got {value!r}")
        return length
    if key == "sp_seq_length_is_variable":
        return _flag(value, name)
    if key == "sp_attn_implementation":
        if text in ("eager", "flex_attention"):
            raise ConfigError(
                f"{name}={value!r}: DeepSpeed's Ulysses runs 'sdpa' or flash attention inside (Accelerate refuses "
                "eager and flex_attention too); write 'sdpa'"
            )
        if text != "sdpa" and text not in _FLASH and not ("/" in text and "flash-attn" in text):
            raise ConfigError(
                f"{name}={value!r} is not an attention Accelerate's ALST takes: 'sdpa', 'flash_attention_2', "
                "'flash_attention_3' or a hub flash-attention kernel such as 'kernels-community/flash-attn2'"
            )
    return text


def read_parallelism(values: Mapping[str, Any], spell: Callable[[str], str] = str) -> Parallelism:
    """What the ParallelismConfig ``values`` (Accelerate's names, see :func:`values_of`) ask of phalanx; ``spell``
    writes a name as the front spells it (``parallelism_config.parallelism_config_cp_size``, ``--...``)."""
    out = Parallelism()
    for key in SIZES:
        if values.get(key) is not None:
            out.sizes[key] = _size(values[key], spell(key))
    options = {k: check_option(k, values[k], spell) for k in OPTIONS if values.get(k) is not None}
    cp, sp = out.sizes.get("cp_size", 1), out.sizes.get("sp_size", 1)
    if cp > 1 and sp > 1:
        raise ConfigError(
            f"{spell('cp_size')}={cp} and {spell('sp_size')}={sp} both split the sequence (ring attention and "
            f"Ulysses), and phalanx uses one of them at a time (Accelerate refuses the pair too); use "
            f"{spell('cp_size')}={cp * sp} alone (causal attention, any head count) or {spell('sp_size')}={cp * sp} "
            "alone (attention heads divisible by it)"
        )
    for key, size in (("cp_size", cp), ("sp_size", sp)):
        if key in out.sizes and size == 1:
            out.accepted[key] = "1: off"
    for key, value in options.items():
        on = cp > 1 if key in _CP_OPTIONS else sp > 1
        if not on:
            size_key = "cp_size" if key in _CP_OPTIONS else "sp_size"
            out.accepted[key] = f"{value!r}: read only with {spell(size_key)} above 1"
            continue
        out.accepted[key] = _what_phalanx_does(key, value, options, sp)
        if key == "cp_comm_strategy":
            out.notes.append(
                f"{spell(key)}={value!r} picks how torch's context_parallel exchanges the kv shards ("
                f"{'one all-gather of them' if value == 'allgather' else 'all-to-alls'}); phalanx's ring attention "
                f"instead passes each kv chunk to the next rank of the ring point-to-point at every step, "
                f"overlapped with the attention of the chunk in hand: the values are the same, the traffic differs"
            )
        elif key == "sp_attn_implementation" and value != "sdpa":
            out.notes.append(
                f"{spell(key)}={value!r}: phalanx's Ulysses runs torch's scaled_dot_product_attention over the whole "
                f"sequence for this rank's heads, in place of {value}: the same values on padded batches. Packed "
                "batches that flash attention tells apart by position_ids restarting at 0 (padding-free packing) are "
                "not told apart here: each document would attend to the ones before it in its row, so pad the "
                "documents apart instead"
            )
        elif key == "sp_seq_length_is_variable" and not value and options.get("sp_seq_length") is None:
            out.notes.append(
                f"{spell(key)}=false without {spell('sp_seq_length')}: Accelerate refuses this; phalanx reads each "
                "batch's length, so the pair asks for nothing"
            )
    return out


def _what_phalanx_does(key: str, value: Any, options: Mapping[str, Any], sp: int) -> str:
    if key == "cp_backend":
        return "'torch': phalanx's ring attention stands in for torch's context_parallel (the same sequence split)"
    if key == "cp_comm_strategy":
        return f"{value!r}: phalanx's ring passes kv chunks point-to-point (see the note)"
    if key == "sp_backend":
        return "'deepspeed': phalanx's sp_size is DeepSpeed's ALST/Ulysses"
    if key == "sp_seq_length":
        fixed = options.get("sp_seq_length_is_variable") is False
        return f"{value}: phalanx reads each batch's length (padded at the end to a multiple of {sp})" + (
            "; it does not check that every batch has this length" if fixed else ""
        )
    if key == "sp_seq_length_is_variable":
        return f"{value!r}: phalanx takes any length in every batch (padded at the end to a multiple of {sp})"
    if value == "sdpa":
        return "'sdpa': phalanx's Ulysses runs SDPA over the whole sequence for this rank's heads"
    return f"{value!r}: phalanx's Ulysses runs SDPA in its place (see the note)"
