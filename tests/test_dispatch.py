"""Big-model inference on the CPU: a model placed over host memory and disk gives the plain model's outputs, bitwise,
from every kind of weights file, within a memory budget that is measured, not assumed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import phalanx
from phalanx.inference import DispatchError, check_device_map, parse_bytes, plan_device_map


class Block(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.register_buffer("scale", torch.rand(d) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)) * self.scale)


class TiedNet(nn.Module):
    """An embedding whose weight the output layer shares, as a language model's."""

    def __init__(self, d: int = 64, blocks: int = 6, vocab: int = 50) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(blocks)])
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


LINEAR_BYTES = (64 * 64 + 64) * 4
BLOCK_BYTES = 2 * LINEAR_BYTES + 64 * 4  # two Linear(64) and the buffer
STREAMING = 2 * LINEAR_BYTES  # what the host keeps free for streamed layers: the one running and the next one


def _reference() -> tuple[TiedNet, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = TiedNet().eval()
    ids = torch.randint(0, 50, (2, 9))
    with torch.inference_mode():
        out = model(ids)
    return model, ids, out


def _empty() -> TiedNet:
    with phalanx.init_empty_weights():
        return TiedNet()


# ----------------------------------------------------------------------------------------------- the plan
def test_memory_sizes_read_as_accelerate_reads_them():
    assert parse_bytes("500MB") == 500 * 10**6 and parse_bytes("10GiB") == 10 * 2**30 and parse_bytes(123) == 123
    assert parse_bytes("1.5 KiB") == 1536
    with pytest.raises(DispatchError, match=r"cannot read the memory size '12 parsecs'.*'500MB', '10GiB'"):
        parse_bytes("12 parsecs")


def test_init_empty_weights_allocates_nothing_and_keeps_ties():
    model = _empty()
    assert all(p.is_meta for p in model.parameters()) and model.head.weight is model.emb.weight
    assert not model.blocks[0].scale.is_meta  # buffers stay real unless include_buffers=True
    with phalanx.init_empty_weights(include_buffers=True):
        assert TiedNet().blocks[0].scale.is_meta


def test_the_plan_fills_the_host_then_disk_keeps_blocks_whole_and_ties_together():
    model = _empty()
    budget = 50 * 64 * 4 + 2 * BLOCK_BYTES + 100 + STREAMING  # the embedding, two blocks, and room to stream
    plan = plan_device_map(model, max_memory={"cpu": budget}, no_split_module_classes=["Block"])
    assert plan == {
        "emb": "cpu",
        "blocks.0": "cpu",
        "blocks.1": "cpu",
        "blocks.2": "disk",
        "blocks.3": "disk",
        "blocks.4": "disk",
        "blocks.5": "disk",
        "head": "cpu",
    }
    # head holds the embedding's weight: it goes where that weight already is, whatever the budget left.
    assert plan_device_map(model, max_memory={"cpu": "1GB"}) == {"": "cpu"}
    # Without no_split, a block that does not fit is split into its layers.
    split = plan_device_map(model, max_memory={"cpu": budget + LINEAR_BYTES + 64 * 4})  # + scale and a
    assert split["blocks.2.a"] == "cpu" and split["blocks.2.b"] == "disk"


def test_a_part_that_fits_nowhere_is_named_with_its_size():
    with pytest.raises(
        DispatchError, match=r"blocks.0 \(Block, 32.8 KiB\) fits on no device \(budgets: cpu: 19.5 KiB\).*offload_dir"
    ):
        plan_device_map(_empty(), max_memory={"cpu": 20000}, no_split_module_classes=["Block"], offload=False)


def test_a_device_map_that_misses_a_module_or_names_a_wrong_one_is_refused():
    model = _empty()
    with pytest.raises(DispatchError, match=r"does not place blocks.5: add their modules"):
        check_device_map(
            model,
            {
                "emb": "cpu",
                "blocks.0": "cpu",
                "blocks.1": "cpu",
                "blocks.2": "cpu",
                "blocks.3": "cpu",
                "blocks.4": "disk",
                "head": "cpu",
            },
        )
    with pytest.raises(DispatchError, match=r"names \['blocks.9'\], which the model does not have"):
        check_device_map(model, {"": "cpu", "blocks.9": "disk"})
    with pytest.raises(DispatchError, match=r"unknown devices"):
        check_device_map(model, {"": "tpu"})
    with pytest.raises(DispatchError, match=r"max_memory has unknown device\(s\) \['gpu0'\]"):
        plan_device_map(model, max_memory={"gpu0": "1GB"})


# ------------------------------------------------------------------------------------------ the execution
@pytest.mark.parametrize("source", ["file", "sharded", "checkpoint"])
def test_load_and_dispatch_gives_the_plain_outputs_bitwise(tmp_path, source):
    ref, ids, want = _reference()
    state = {k: v.contiguous() for k, v in ref.state_dict().items() if k != "head.weight"}  # the tie stored once
    if source == "file":
        path = tmp_path / "model.safetensors"
        save_file(state, path)
    elif source == "sharded":
        path = tmp_path
        names = sorted(state)
        halves = {
            "model-00001-of-00002.safetensors": names[: len(names) // 2],
            "model-00002-of-00002.safetensors": names[len(names) // 2 :],
        }
        for file, keys in halves.items():
            save_file({k: state[k] for k in keys}, tmp_path / file)
        index = {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        engine = phalanx.Engine()
        engine.prepare(ref)
        path = engine.save_state(tmp_path / "ckpt")
    budget = 50000 + STREAMING
    model = phalanx.load_and_dispatch(_empty(), path, max_memory={"cpu": budget}, no_split_module_classes=["Block"])
    assert model.hf_device_map == {
        "emb": "cpu",
        "blocks.0": "cpu",
        **{f"blocks.{i}": "disk" for i in range(1, 6)},
        "head": "cpu",
    }
    with torch.inference_mode():
        assert torch.equal(model(ids), want)
        assert torch.equal(model(ids), want)  # again: the disk weights were released and are read back
    assert model.blocks[3].a.weight.is_meta  # released after its forward


def test_dispatch_of_a_model_in_memory_offloads_to_a_directory(tmp_path):
    ref, ids, want = _reference()
    with pytest.raises(DispatchError, match=r"blocks.0 \(Block, 32.8 KiB\) fits on no device .*pass offload_dir"):
        phalanx.dispatch(_reference()[0], max_memory={"cpu": 40000}, no_split_module_classes=["Block"])
    with pytest.raises(DispatchError, match=r"puts 5 tensor\(s\) on disk \(blocks.5.scale, ...\): pass offload_dir"):
        phalanx.dispatch(
            _reference()[0],
            {
                "emb": "cpu",
                "blocks.0": "cpu",
                "blocks.1": "cpu",
                "blocks.2": "cpu",
                "blocks.3": "cpu",
                "blocks.4": "cpu",
                "blocks.5": "disk",
                "head": "cpu",
            },
        )
    model = phalanx.dispatch(
        ref, max_memory={"cpu": 50000 + STREAMING}, no_split_module_classes=["Block"], offload_dir=tmp_path
    )
    assert model.hf_device_map["blocks.0"] == "cpu" and model.hf_device_map["blocks.5"] == "disk"
    assert (tmp_path / "offloaded.safetensors").is_file()
    with torch.no_grad():
        assert torch.equal(model(ids), want)


# A model of about 200 MB under a host budget of 60 MB: peak resident memory over the process's baseline (its
# high-water mark before anything is loaded) must stay below the budget plus the largest block.
RSS_SCRIPT = textwrap.dedent(
    """\
    import json, sys, torch
    from torch import nn
    import phalanx

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        def forward(self, x):
            return x + self.b(torch.relu(self.a(x)))

    def build():
        return nn.Sequential(*[Block(1024) for _ in range(24)])   # 24 x 8.4 MB = 201 MB

    mode, path = sys.argv[1], sys.argv[2]
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(0))
    if mode == "write":
        from safetensors.torch import save_file
        torch.manual_seed(0)
        model = build()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path + "/model.safetensors")
        with torch.inference_mode():
            torch.save(model(x), path + "/out.pt")   # the test's own reference output (trusted: written here)
    else:
        with phalanx.init_empty_weights():
            model = build()
        want = torch.load(path + "/out.pt", weights_only=True)
        with torch.inference_mode():
            # the kernels, warm
            torch.relu(torch.nn.functional.linear(x, torch.zeros(8, 1024), torch.zeros(8))) + x[:, :8]
        base = hwm()
        model = phalanx.load_and_dispatch(model, path + "/model.safetensors", max_memory={"cpu": "60MB"},
                                          no_split_module_classes=["Block"])
        with torch.inference_mode():
            out = model(x)
            out = model(x)
        print(json.dumps({"equal": torch.equal(out, want), "base": base, "peak": hwm(),
                          "disk": list(model.hf_device_map.values()).count("disk")}))
    """
)


def test_a_200_mb_model_runs_in_a_60_mb_host_budget(tmp_path):
    script = tmp_path / "rss.py"
    script.write_text(RSS_SCRIPT)
    subprocess.run([sys.executable, str(script), "write", str(tmp_path)], check=True, timeout=300)
    proc = subprocess.run(
        [sys.executable, str(script), "run", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["equal"] and got["disk"] >= 17  # 60 MB hold 7 of the 24 blocks
    block = 2 * (1024 * 1024 + 1024) * 4
    grew = got["peak"] - got["base"]
    assert grew < 60 * 10**6 + block, f"peak grew by {grew / 2**20:.1f} MiB over the baseline"


def test_a_transformers_model_generates_the_same_tokens_from_disk(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=6, n_embd=64, n_head=4, vocab_size=97, n_positions=64)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(config).eval()
    plain.save_pretrained(tmp_path)  # model.safetensors, the tied lm_head stored once
    ids = torch.randint(0, 97, (1, 5))
    want = plain.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    with phalanx.init_empty_weights():
        model = transformers.GPT2LMHeadModel(config).eval()
    block = sum(p.numel() * 4 for p in plain.transformer.h[0].parameters())
    model = phalanx.load_and_dispatch(model, tmp_path, max_memory={"cpu": 3 * block})  # GPT2Block is _no_split
    assert model.hf_device_map["transformer.h.5"] == "disk"
    assert "transformer.h.0.attn" not in model.hf_device_map  # blocks are never split
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    with torch.inference_mode():
        got = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


def test_dispatch_plan_prints_the_map_and_the_bytes_per_device_before_loading(tmp_path):
    ref, _, _ = _reference()
    save_file(
        {k: v.contiguous() for k, v in ref.state_dict().items() if k != "head.weight"}, tmp_path / "w.safetensors"
    )
    cli = [sys.executable, "-m", "phalanx", "dispatch-plan"]
    proc = subprocess.run(
        [*cli, str(tmp_path / "w.safetensors"), "--max-memory", "cpu=60000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"dispatch plan for {tmp_path / 'w.safetensors'} (safetensors weights, ")
    assert any(line.split() == ["blocks.5", "disk"] for line in lines), proc.stdout
    assert lines[-1].startswith("bytes per device: cpu ") and "(budget 58.6 KiB), disk " in lines[-1]
    bad = subprocess.run(
        [*cli, str(tmp_path / "w.safetensors"), "--max-memory", "cpu"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "--max-memory 'cpu': write DEVICE=SIZE, e.g. cpu=2GiB" in bad.stderr


def _split(_: int = 0) -> list:
    engine = phalanx.Engine()
    out = []
    for pad in (False, True):
        with engine.split_between_processes(list(range(8)), apply_padding=pad) as mine:
            out.append(mine)
    with engine.split_between_processes({"x": torch.arange(8), "y": list("abcdefgh")}) as mine:
        out.append((mine["x"].tolist(), mine["y"]))
    return out


def test_split_between_processes_gives_each_rank_its_share_as_accelerate_does(run_ranks):
    # 8 items over 3 ranks: 3, 3, 2; padded, the last rank repeats its last item. A dict is split value by value.
    assert run_ranks(_split, 3) == [
        [[0, 1, 2], [0, 1, 2], ([0, 1, 2], ["a", "b", "c"])],
        [[3, 4, 5], [3, 4, 5], ([3, 4, 5], ["d", "e", "f"])],
        [[6, 7], [6, 7, 7], ([6, 7], ["g", "h"])],
    ]
    assert _split() == [list(range(8)), list(range(8)), (list(range(8)), list("abcdefgh"))]


def test_a_host_budget_too_small_to_run_the_largest_layer_is_named():
    # Streaming from disk holds the layer running and the next one: 2 x 16.2 KiB here.
    with pytest.raises(
        DispatchError,
        match=r"max_memory\['cpu'\]=19.5 KiB is too small to run the model from disk: its "
        r"largest layer, blocks.0.a \(16.2 KiB\).* at least 32.5 KiB \(33280 bytes\)",
    ):
        phalanx.load_and_dispatch(_empty(), "unused", max_memory={"cpu": 20000})


def test_dtype_loads_and_streams_the_weights_in_that_dtype(tmp_path):
    ref, ids, _ = _reference()
    save_file(
        {k: v.contiguous() for k, v in ref.state_dict().items() if k != "head.weight"}, tmp_path / "w.safetensors"
    )
    with torch.inference_mode():
        want = ref.to(torch.bfloat16)(ids)
    # Sizes count in bf16: a budget that holds two fp32 blocks holds four bf16 ones.
    budget = 50 * 64 * 2 + 4 * BLOCK_BYTES // 2 + 100 + STREAMING // 2
    model = phalanx.load_and_dispatch(
        _empty(),
        tmp_path / "w.safetensors",
        max_memory={"cpu": budget},
        no_split_module_classes=["Block"],
        dtype=torch.bfloat16,
    )
    assert [model.hf_device_map[f"blocks.{i}"] for i in range(6)] == ["cpu"] * 4 + ["disk"] * 2
    with torch.inference_mode():
        got = model(ids)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_an_automatic_map_leaves_gpu_headroom_for_activations(monkeypatch):
    """A GPU without a max_memory entry gets 90% of its free memory for weights (faked CUDA: two GPUs)."""
    from phalanx.inference import plan

    free = {0: 10 * 2**30, 1: 4 * 2**30}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (free[i], 80 * 2**30))
    budgets = plan._devices(None, offload=False)
    assert budgets[0] == int(free[0] * 0.9) and budgets[1] == int(free[1] * 0.9)
    given = plan._devices({0: "2GiB", "cpu": "1GiB"}, offload=False)
    assert given[0] == 2 * 2**30 and 1 not in given and given["cpu"] == 2**30  # a budget given is taken as it is
