"""`simplefsdp.hf.Trainer`: Hugging Face's Trainer on a simplefsdp model.

End to end (slow): a tiny `LlamaForCausalLM` trained for 4 steps by the plain Trainer in one process
and by `simplefsdp.hf.Trainer` on 2 gloo ranks under torchrun, compiled with inductor through the
Trainer's `torch_compile`, two micro-batches accumulated per step (`_trainer_job.py`): the saved
weights agree within the fp32 parity tolerance, `from_pretrained` loads them, and a second Trainer
resumed from the step-2 checkpoint ends with the same weights.
[Note: Trainer parity tolerance] The two runs do the same arithmetic on the same sequences (the
loss is summed over both ranks' tokens and divided by the global count, as in one process), but
inductor fuses and the sharded reductions add in another order: a few fp32 ulps per step. 64 ulps
(relative and absolute), the suite's tolerance for compiled parity, holds with room (seen: 0.42 of it).
The fast tier checks what the Trainer refuses, on a fake world of 8 (no data moves, no compile).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import simplefsdp
import simplefsdp.hf
from tests.hf import _trainer_job as job
from tests.simplefsdp.test_training import FP32_TOL

REPO = Path(__file__).resolve().parents[2]


def _run(command: list[str]) -> None:
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=500, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_match_one_process_save_and_resume(tmp_path):
    module = ["-m", "tests.hf._trainer_job"]
    _run([sys.executable, *module, "--out", str(tmp_path / "one"), "--mode", "reference"])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    _run([*torchrun, *module, "--out", str(tmp_path / "two"), "--mode", "simplefsdp"])

    reference = load_file(tmp_path / "one" / "final" / "model.safetensors")
    ours = load_file(tmp_path / "two" / "final" / "model.safetensors")
    assert ours.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, **FP32_TOL, msg=lambda m, name=name: f"{name}: {m}")
    losses = json.loads((tmp_path / "two" / "losses.json").read_text())
    expected = json.loads((tmp_path / "one" / "losses.json").read_text())
    assert list(losses["run"]) == ["1", "2", "3", "4"]
    torch.testing.assert_close(
        torch.tensor(list(losses["run"].values())), torch.tensor(list(expected.values())), **FP32_TOL
    )

    # save_model wrote a full state dict from_pretrained loads, config included
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "two" / "final")
    assert all(torch.equal(loaded.state_dict()[name], value) for name, value in ours.items())
    # the checkpoint holds the sharded model + optimizer state; resuming from step 2 repeats steps 3-4
    assert (tmp_path / "two" / "checkpoint-2" / "simplefsdp" / "step_000000002").is_dir()
    assert list(losses["resumed"]) == ["1", "2", "3", "4"]  # 1-2 from the checkpoint's history
    assert losses["resumed"]["3"] == losses["run"]["3"]
    assert losses["resumed"]["4"] == losses["run"]["4"]
    resumed = load_file(tmp_path / "two" / "resumed" / "model.safetensors")
    for name, value in ours.items():
        assert torch.equal(resumed[name], value), f"{name}: the resumed run ended elsewhere"


@pytest.fixture(scope="module")
def wrapped(fake_world8):
    return simplefsdp.wrap(job.model())


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"bf16": True}, "TrainingArguments.bf16=True cannot be used: autocast"),
        ({"activation_checkpointing": True}, "checkpointing=True cannot be used: use simplefsdp.checkpoint_blocks"),
        ({"fsdp": "full_shard"}, "TrainingArguments.fsdp=.* sharded by simplefsdp already"),
        (
            {"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps"},
            "load_best_model_at_end=True cannot be used: the Trainer's best-model loading is not collective",
        ),
    ],
)
def test_arguments_that_would_act_on_the_model_again_are_refused(wrapped, tmp_path, setting, named):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **setting)
    with pytest.raises(ValueError, match=named):
        simplefsdp.hf.Trainer(model=wrapped, args=args)


def test_only_a_wrapped_model_compiled_in_place_is_taken(wrapped, tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(TypeError, match=r"trains a model simplefsdp\.wrap\(\) sharded; got LlamaForCausalLM"):
        simplefsdp.hf.Trainer(model=job.model(), args=args)
    with pytest.raises(TypeError, match="compiled in place"):
        simplefsdp.hf.Trainer(model=torch.compile(wrapped), args=args)
