"""apply_policy on Hugging Face models: the forward signature libraries read, Trainer, save_pretrained.

Models are built from small configs; nothing is downloaded.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import io
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import polyamp_torch  # noqa: E402

VOCAB, LENGTH, SAMPLES = 100, 8, 16


def tiny_bert() -> Any:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
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


@pytest.mark.parametrize("gradient_checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
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
