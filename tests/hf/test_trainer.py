"""`simplefsdp.hf.Trainer`: Hugging Face's Trainer on a simplefsdp model.

End to end (slow): a tiny `LlamaForCausalLM` trained for 4 steps by the plain Trainer in one process
and by `simplefsdp.hf.Trainer` on 2 gloo ranks under torchrun, compiled with inductor through the
Trainer's `torch_compile`, two micro-batches accumulated per step (`_trainer_job.py`): the saved
weights agree within the fp32 parity tolerance, `from_pretrained` loads them, and a second Trainer
resumed from the step-2 checkpoint ends with the same weights. The ranks' process group is
simplefsdp's one-worker gloo ([Note: torch's two gloo workers race] in `simplefsdp/gloo.py`).
[Note: Trainer parity tolerance] The two runs do the same arithmetic on the same sequences (the
loss is summed over both ranks' tokens and divided by the global count, as in one process), but
inductor fuses and the sharded reductions add in another order: a few fp32 ulps per step. The
logged gradient norms (before clipping) and losses agree within 64 ulps, the suite's tolerance for
compiled parity (seen: within 2 ulps). The weights get twice that: AdamW divides each step by the
root mean square of an element's gradients, which magnifies their rounding where successive
gradients nearly cancel (seen: 0.42 of 64 ulps with transformers 5.24's initial weights; with 4.x's,
one element of 22688 at 1.03 of it, the next at 0.4). A gradient off by a constant factor, which
AdamW would hide in the weights, shows in the gradient norms.

fp16 (slow): the same model with its loss multiplied by 2^-16 (most float16 gradients would
underflow unscaled), SGD with every step clipped, in float32 in one process and with `fp16=True` on
a float16-wrapped model on 2 ranks (eager): the parameter updates agree within 8 float16 unit
roundoffs of the largest update, the tolerance and reasoning of [Note: float16 scaling tolerance]
in tests/simplefsdp/test_loss_scaling.py (seen: 1.3), and so do the logged gradient norms (the
clip sees unscaled gradients: with scaled ones the updates vanish, off by 2048 of them). The
resumed Trainer ends with the weights and the loss-scaler state of the uninterrupted one.

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
from simplefsdp._compat import check_trainer_internals
from tests.hf import _trainer_job as job
from tests.simplefsdp.test_training import FP32_TOL

REPO = Path(__file__).resolve().parents[2]
ADAMW_TOL = {key: 2 * value for key, value in FP32_TOL.items()}  # [Note: Trainer parity tolerance]


def _run(command: list[str]) -> None:
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=500, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]


def _job(out: Path, mode: str, *, ranks: int) -> dict:
    """Run `_trainer_job.py` in `mode` (under torchrun when `ranks` > 1); its run.json."""
    module = ["-m", "tests.hf._trainer_job", "--out", str(out), "--mode", mode]
    torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--standalone"]
    _run([sys.executable, *(torchrun if ranks > 1 else []), *module])
    return json.loads((out / "run.json").read_text())


def _both(tmp_path: Path, reference_mode: str, our_mode: str) -> tuple[dict, dict, dict, dict]:
    """Run `reference_mode` in one process and `our_mode` on 2 ranks of simplefsdp's one-worker gloo:
    (reference run.json, ours, reference final weights, ours)."""
    expected = _job(tmp_path / "one", reference_mode, ranks=1)
    run = _job(tmp_path / "two", our_mode, ranks=2)
    assert run["backend"] == simplefsdp.gloo.BACKEND
    weights = (load_file(tmp_path / name / "final" / "model.safetensors") for name in ("one", "two"))
    return expected, run, *weights


def _check_resumed(out: Path, run: dict) -> None:
    """The Trainer resumed from step 2 repeated steps 3-4: same losses, same final weights."""
    assert list(run["run"]["loss"]) == ["1", "2", "3", "4"]
    assert list(run["resumed"]["loss"]) == ["1", "2", "3", "4"]  # 1-2 from the checkpoint's history
    assert run["resumed"]["loss"]["3"] == run["run"]["loss"]["3"]
    assert run["resumed"]["loss"]["4"] == run["run"]["loss"]["4"]
    final = load_file(out / "final" / "model.safetensors")
    resumed = load_file(out / "resumed" / "model.safetensors")
    for name, value in final.items():
        assert torch.equal(resumed[name], value), f"{name}: the resumed run ended elsewhere"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_match_one_process_save_and_resume(tmp_path):
    expected, run, reference, ours = _both(tmp_path, "reference", "simplefsdp")
    assert ours.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, **ADAMW_TOL, msg=lambda m, name=name: f"{name}: {m}")
    for key in ("loss", "grad_norm"):
        ran, wanted = (torch.tensor(list(history[key].values())) for history in (run["run"], expected))
        torch.testing.assert_close(ran, wanted, **FP32_TOL, msg=lambda m, key=key: f"{key}: {m}")

    # save_model wrote a full state dict from_pretrained loads, config included
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "two" / "final")
    assert all(torch.equal(loaded.state_dict()[name], value) for name, value in ours.items())
    # the checkpoint holds the sharded model + optimizer state; resuming from step 2 repeats steps 3-4
    assert (tmp_path / "two" / "checkpoint-2" / "simplefsdp" / "step_000000002").is_dir()
    _check_resumed(tmp_path / "two", run)


FP16_U = 2.0**-11  # float16's unit roundoff; the bound is 8 of them ([Note: float16 scaling tolerance])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fp16_scales_the_loss_and_trains_like_float32(tmp_path):
    expected, run, reference, ours = _both(tmp_path, "tiny-reference", "tiny-fp16")
    start = job.model().state_dict()
    largest = max(float((reference[name] - start[name]).abs().max()) for name in reference)
    worst = max(float((ours[name] - reference[name]).abs().max()) for name in reference)
    assert worst <= 8 * FP16_U * largest, f"updates off by {worst / largest / FP16_U:.1f} float16 roundoffs"
    torch.testing.assert_close(
        torch.tensor(list(run["run"]["grad_norm"].values())),
        torch.tensor(list(expected["grad_norm"].values())),
        rtol=8 * FP16_U,
        atol=0,
    )
    # no step overflowed at the initial scale: 4 good steps, also counted by the resumed Trainer's scaler
    assert run["run"]["scaler"]["scale"] == 2.0**16
    assert run["run"]["scaler"]["_growth_tracker"] == job.STEPS
    assert run["resumed"]["scaler"] == run["run"]["scaler"]
    _check_resumed(tmp_path / "two", run)


# transformers 5 renamed `gradient_checkpointing` (which it still takes, with a FutureWarning)
CHECKPOINTING = next(
    name
    for name in ("activation_checkpointing", "gradient_checkpointing")
    if hasattr(transformers.TrainingArguments, name)
)


@pytest.fixture(scope="module")
def wrapped(fake_world8):
    return simplefsdp.wrap(job.model())


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"bf16": True}, "TrainingArguments.bf16=True cannot be used: autocast"),
        ({"fp16": True}, r"TrainingArguments.fp16=True cannot be used: the model computes in no float16"),
        ({CHECKPOINTING: True}, "checkpointing=True cannot be used: use simplefsdp.checkpoint_blocks"),
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


def test_a_float16_model_needs_fp16_true(fake_world8, tmp_path):
    policy = simplefsdp.MixedPrecisionPolicy(param_dtype=torch.float16)
    model = simplefsdp.wrap(job.model(), mp_policy=policy)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(
        ValueError, match=r"gathers or reduces in float16 \(its mp_policy\): set TrainingArguments\.fp16"
    ):
        simplefsdp.hf.Trainer(model=model, args=args)


def test_missing_trainer_internals_fail_in_one_line(monkeypatch):
    import accelerate

    check_trainer_internals.cache_clear()
    monkeypatch.setattr(accelerate, "__version__", "1.13.0")
    with pytest.raises(RuntimeError, match=r"simplefsdp\.hf needs accelerate>=1\.14 .*; found 1\.13\.0$"):
        check_trainer_internals()
    monkeypatch.undo()
    monkeypatch.delattr(transformers.Trainer, "_load_optimizer_and_scheduler")
    named = r"overrides Trainer\._load_optimizer_and_scheduler, which transformers \S+ does not have"
    with pytest.raises(RuntimeError, match=named):
        check_trainer_internals()
    monkeypatch.undo()
    check_trainer_internals.cache_clear()
    check_trainer_internals()  # the installed versions pass
