"""apply_policy on Hugging Face models: the forward signature libraries read, Trainer, save_pretrained.

Models are built from small configs; nothing is downloaded.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import polyamp  # noqa: E402
import polyamp_torch  # noqa: E402

if TYPE_CHECKING:
    from conftest import ImportWithout

VOCAB, LENGTH, SAMPLES = 100, 8, 16


def tiny_bert(**config: Any) -> Any:
    """A two-layer BERT classifier, width 32, from seed 0; ``config``: more BertConfig settings."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
        **config,
    )
    return transformers.BertForSequenceClassification(config)


def tiny_gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config)


class Batches(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """In-memory token classification data: the columns a tokenizer would give, and labels."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.input_ids = torch.randint(1, VOCAB, (SAMPLES, LENGTH), generator=generator)
        self.labels = torch.randint(0, 2, (SAMPLES,), generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": torch.ones(LENGTH, dtype=torch.long),
            "labels": self.labels[index],
        }


@pytest.mark.parametrize(("build", "norms"), [(tiny_bert, "*LayerNorm"), (tiny_gpt2, "*ln_*")], ids=["bert", "gpt2"])
def test_forward_signature_is_the_models_own(build: Any, norms: str) -> None:
    expected = inspect.signature(build().forward)
    assert {"input_ids", "attention_mask", "labels"} <= set(expected.parameters)
    model = polyamp_torch.apply_policy(build(), "mixed_bfloat16", keep_float32=[norms])
    assert isinstance(model.forward, type(model.__dict__["forward"]))  # the policy's forward is installed
    assert inspect.signature(model.forward) == expected
    norm = next(sub for name, sub in model.named_modules() if isinstance(sub, torch.nn.LayerNorm))
    assert inspect.signature(norm.forward) == inspect.signature(torch.nn.LayerNorm(4).forward)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for other in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        assert inspect.signature(other.forward) == expected


@pytest.mark.parametrize(
    "gradient_checkpointing",
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["plain", "gradient_checkpointing"],
)
def test_trainer_trains_a_model_under_a_policy(tmp_path: Path, gradient_checkpointing: bool) -> None:
    model = polyamp_torch.apply_policy(tiny_bert(), "mixed_bfloat16")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    seen: list[torch.dtype] = []
    model.bert.encoder.layer[0].attention.self.query.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    # Recomputed layers must match their forward's dtypes. Newer transformers renamed the option.
    fields = {field.name for field in dataclasses.fields(transformers.TrainingArguments)}
    option = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=3,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        **{option: gradient_checkpointing, f"{option}_kwargs": {"use_reentrant": False}},
    )
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=Batches())
    result = trainer.train()
    assert result.global_step == 3
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and all(loss == loss and loss > 0 for loss in losses)  # finite, logged each step
    # Each step ran the body under the policy (a checkpointed layer runs again in backward).
    assert seen == [torch.bfloat16] * (6 if gradient_checkpointing else 3)
    changed = [name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])]
    assert "classifier.weight" in changed and "bert.embeddings.word_embeddings.weight" in changed
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_save_pretrained_round_trips_and_the_policy_stays(tmp_path: Path) -> None:
    model = polyamp_torch.apply_policy(tiny_bert(), "mixed_float16", keep_float32=["classifier"])
    model.save_pretrained(tmp_path)
    loaded = transformers.BertForSequenceClassification.from_pretrained(tmp_path)
    assert "forward" not in loaded.__dict__  # a saved model is plain weights and config
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = Batches().input_ids[:2]
    model.eval()  # as from_pretrained leaves the loaded one: no dropout
    assert not loaded.training
    assert model(input_ids=ids).logits.dtype == torch.float32
    assert "forward" in model.__dict__
    polyamp_torch.apply_policy(loaded, "mixed_float16", keep_float32=["classifier"])
    assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


# -- polyamp's scaler in the Trainer (polyamp_torch.transformers) --------------------------------------------------

STEPS, PLANTED = 6, {1, 3}  # optimizer steps; the steps whose classifier gradient is made inf


class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Token classification rows 0..n-1, leaving out the batches (of 4) in ``leave_out``."""

    def __init__(self, leave_out: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        generator = torch.Generator().manual_seed(1)
        input_ids = torch.randint(1, VOCAB, (STEPS * 4, LENGTH), generator=generator)
        labels = torch.randint(0, 2, (STEPS * 4,), generator=generator)
        keep = [i for i in range(STEPS * 4) if i // 4 not in leave_out]
        self.input_ids, self.labels = input_ids[keep], labels[keep]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}


def planted_bert(bad: set[int]) -> Any:
    """A dropout-free tiny BERT whose classifier weight gradient is inf at the backward passes in ``bad``."""
    model = tiny_bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    count = [0]

    def plant(grad: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        return torch.full_like(grad, float("inf")) if count[0] - 1 in bad else grad

    model.classifier.weight.register_hook(plant)
    return model


def bf16_trainer(tmp_path: Path, model: Any, data: Any, max_steps: int, **options: Any) -> Any:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # each Trainer's Accelerator starts clean
    settings: dict[str, Any] = {
        "use_cpu": True,
        "bf16": True,
        "per_device_train_batch_size": 4,
        "train_sampling_strategy": "sequential",
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "report_to": [],
        "save_strategy": "no",
        "disable_tqdm": True,
        **options,
    }
    arguments = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=max_steps, **settings)
    return transformers.Trainer(model=model, args=arguments, train_dataset=data)


def test_prepare_trainer_guards_bf16_and_logs_the_skips(tmp_path: Path) -> None:
    polyamp_transformers = pytest.importorskip("polyamp_torch.transformers")
    model = planted_bert(PLANTED)
    trainer = bf16_trainer(tmp_path / "guarded", model, Rows(), STEPS)
    scaler = polyamp_transformers.prepare_trainer(trainer)
    assert trainer.accelerator.scaler is scaler and scaler.guarding
    assert isinstance(trainer.callback_handler.callbacks[0], polyamp_transformers.PolyampCallback)
    assert trainer.train().global_step == STEPS
    entries = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in entries] == list(range(1, STEPS + 1))
    assert [entry["skipped_steps"] for entry in entries] == [0.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    assert [entry.get("skipped_steps/non_finite") for entry in entries] == [None, 1.0, 1.0, 2.0, 2.0, 2.0]
    assert all("loss_scale" not in entry for entry in entries)  # bf16: guarded, not scaled
    # The schedule does not advance on a skipped step (the Trainer asks the Accelerator, which asks the scaler).
    rates = [entry["learning_rate"] for entry in entries]
    assert rates[1] == rates[2] and rates[3] == rates[4]
    assert all(bool(p.isfinite().all()) for p in model.parameters())


def test_prepare_trainer_equals_the_trainer_without_the_skipped_batches(tmp_path: Path) -> None:
    # A skipped step leaves parameters, Adam's state and the schedule as they were: the guarded run is the native
    # bf16 run on the data without the planted batches, bit for bit (a constant schedule: fewer steps in all).
    polyamp_transformers = pytest.importorskip("polyamp_torch.transformers")
    guarded = planted_bert(PLANTED)
    trainer = bf16_trainer(tmp_path / "guarded", guarded, Rows(), STEPS, lr_scheduler_type="constant")
    polyamp_transformers.prepare_trainer(trainer)
    trainer.train()
    native = planted_bert(set())
    reference = bf16_trainer(
        tmp_path / "native", native, Rows(PLANTED), STEPS - len(PLANTED), lr_scheduler_type="constant"
    )
    assert reference.accelerator.scaler is None
    reference.train()
    for (name, p), q in zip(guarded.named_parameters(), native.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_trainer_checkpoints_resume_polyamps_scaler(tmp_path: Path) -> None:
    polyamp_transformers = pytest.importorskip("polyamp_torch.transformers")
    straight = planted_bert(PLANTED)
    trainer = bf16_trainer(tmp_path / "straight", straight, Rows(), STEPS, save_strategy="steps", save_steps=3)
    scaler = polyamp_transformers.prepare_trainer(trainer, spike=polyamp.SpikeRule(window=2, warmup=2))
    trainer.train()
    saved = torch.load(tmp_path / "straight" / "checkpoint-3" / "scaler.pt", weights_only=True)
    assert saved["polyamp_format"] == 1 and len(saved["spike_window"]) == 2  # polyamp's dict, read with weights_only
    resumed_model = planted_bert({b - 3 for b in PLANTED if b >= 3})
    resumed = bf16_trainer(tmp_path / "straight", resumed_model, Rows(), STEPS)
    resumed_scaler = polyamp_transformers.prepare_trainer(resumed, spike=polyamp.SpikeRule(window=2, warmup=2))
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-3"))
    assert resumed_scaler.state_dict() == scaler.state_dict()
    for p, q in zip(straight.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)
    # The logged skip count goes on from the checkpoint's (one skip in its three steps), as in the straight run.
    assert saved["skipped_steps"] == 1

    def logged(trainer: Any) -> dict[int, float]:
        return {e["step"]: e["skipped_steps"] for e in trainer.state.log_history if "skipped_steps" in e}

    assert logged(trainer) == {1: 0.0, 2: 1.0, 3: 1.0, 4: 2.0, 5: 2.0, 6: 2.0}
    assert {step: count for step, count in logged(resumed).items() if step > 3} == {4: 2.0, 5: 2.0, 6: 2.0}


def test_prepare_trainer_arguments_and_the_missing_package_hint(import_without: ImportWithout) -> None:
    polyamp_transformers = pytest.importorskip("polyamp_torch.transformers")
    with pytest.raises(polyamp.PolyampTypeError, match=r"takes a transformers.Trainer.*prepare_accelerator"):
        polyamp_transformers.prepare_trainer(object())
    with pytest.raises(polyamp.PolyampTypeError, match=r"needs the polyamp\.LossScaler"):
        polyamp_transformers.PolyampCallback(object())  # type: ignore[arg-type]
    with pytest.raises(polyamp.BackendNotInstalledError, match=r"pip install transformers accelerate"):
        import_without("transformers", "polyamp_torch.transformers")
