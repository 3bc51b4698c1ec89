"""BERT-joint question answering: any Hugging Face encoder with an extractive-QA head, plus an
answer-type head on [CLS].

The model wraps an `AutoModelForQuestionAnswering` instead of a bare `AutoModel` so that the span
head *is* Hugging Face's own (`qa_outputs` for BERT, RoBERTa, ELECTRA, ...): the exported folder
is then a standard extractive-QA checkpoint that any tool taking a Hugging Face QA model can load,
with the answer-type head riding along as one extra weight. It also avoids BERT's pooler, which a
span head never uses and which would make DDP fail on unused parameters.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForQuestionAnswering, PretrainedConfig

from distqa.config import ModelConfig
from distqa.console import no_load_report
from distqa.errors import DistqaError
from distqa.models import RANDOM_MODELS, DamagedWeights, build_hf_model, hf_config

# 0 unknown, 1 yes, 2 no, 3 short, 4 long (the order of the Natural Questions baseline).
ANSWER_TYPES = ("unknown", "yes", "no", "short", "long")
ANSWER_TYPE_HEAD = "answer_type_head"  # attribute and key prefix of the extra weights


def _answer_type_head_weights(path: Path) -> dict[str, torch.Tensor]:
    """The answer-type head stored in a distqa export (empty for any other checkpoint)."""
    if not path.is_file():
        return {}
    prefix = f"{ANSWER_TYPE_HEAD}."
    try:
        weights = load_file(str(path))
    except SafetensorError as err:
        raise DamagedWeights(
            f"{path} is damaged ({str(err).splitlines()[0]}): set model.name to a whole model"
        ) from err
    return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}


class BertJointQA(nn.Module):
    """Encoder + start/end span head + 5-way answer-type head on the first ([CLS]) token."""

    def __init__(self, qa_model: nn.Module) -> None:
        super().__init__()
        self.qa = qa_model
        self.config: PretrainedConfig = qa_model.config
        self.answer_type_head = nn.Linear(self.config.hidden_size, len(ANSWER_TYPES))

    @classmethod
    def build(cls, cfg: ModelConfig, missing: list[str] | None = None) -> BertJointQA:
        """The model `model.name` asks for: a RANDOM_MODELS name, a Hugging Face id, or a local folder.
        `missing`, when given, gets the names of the weights the checkpoint lacked (new, random)."""
        if cfg.name in RANDOM_MODELS:
            return cls(build_hf_model(AutoModelForQuestionAnswering, cfg))
        config = hf_config(cfg)
        head = _answer_type_head_weights(Path(cfg.name) / "model.safetensors")
        # A folder distqa exported holds `answer_type_head.*` beside the QA weights; Hugging Face
        # would report them as unexpected, but we load them ourselves just below. (A caller asking
        # for the `missing` weights says what they mean itself.)
        with no_load_report() if head or missing is not None else contextlib.nullcontext():
            # A plain encoder checkpoint (bert-base-uncased) gets a freshly initialised span head.
            qa = build_hf_model(AutoModelForQuestionAnswering, cfg, config=config, missing=missing)
        model = cls(qa)
        if head:
            model.answer_type_head.load_state_dict(head)
        elif missing is not None:
            missing.extend(f"{ANSWER_TYPE_HEAD}.{key}" for key in model.answer_type_head.state_dict())
        return model

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> BertJointQA:
        """Load a folder written by `save_pretrained` (the trained model, both heads). Refused in one
        line: a damaged weights file, or a folder whose checkpoint lacks weights (a plain encoder:
        its span and answer-type heads would be random, and so would every answer)."""
        missing: list[str] = []
        weights = Path(directory) / "model.safetensors"
        try:
            model = cls.build(ModelConfig(name=str(directory)), missing=missing)
        except DamagedWeights as err:
            raise DistqaError(
                f"{weights} is damaged ({str(err.__cause__).splitlines()[0]}): export the model again (distqa export)"
            ) from err
        if missing:
            shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
            raise DistqaError(
                f"{directory} is not a model trained for Natural Questions: its checkpoint lacks {shown} (they "
                "would be random): give the model/ folder of a distqa training run, or its output_dir"
            )
        return model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        # Hugging Face's own QA forward gives the span logits exactly as any HF tool computes
        # them; the last hidden state (already kept for backward) feeds the answer-type head.
        out = self.qa(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            output_hidden_states=True,
        )
        cls_state = out.hidden_states[-1][:, 0]
        return {
            "start_logits": out.start_logits,
            "end_logits": out.end_logits,
            "answer_type_logits": self.answer_type_head(cls_state),
        }

    def save_pretrained(self, directory: str | Path) -> None:
        """Hugging Face form: config.json + model.safetensors with the QA model's own key names
        and the answer-type head as extra `answer_type_head.*` weights."""
        state = dict(self.qa.state_dict())
        for key, value in self.answer_type_head.state_dict().items():
            state[f"{ANSWER_TYPE_HEAD}.{key}"] = value
        self.qa.save_pretrained(str(directory), state_dict=state)


def bert_joint_loss(outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean of the start, end and answer-type cross-entropies (the BERT-joint baseline's loss).

    Computed in fp32 whatever the autocast dtype: the log-softmax over 512 positions is where
    half precision loses most. The span softmax covers the window's own tokens only: a window is
    padded to the longest in its micro-batch, so with the padding in the softmax its loss depended
    on its neighbours, and 1 process at batch 2, 2 at batch 1 and train.grad_accum=2 trained other
    weights (2e-3 apart on the NQ fixture). A label on padding is then an infinite loss: the run stops.
    """
    start = F.cross_entropy(_window_only(outputs["start_logits"], batch), batch["start_positions"])
    end = F.cross_entropy(_window_only(outputs["end_logits"], batch), batch["end_positions"])
    kind = F.cross_entropy(outputs["answer_type_logits"].float(), batch["answer_type"])
    return (start + end + kind) / 3.0


def _window_only(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Span logits in fp32 with the padding's set to -inf (exp(-inf) is 0: nothing in the softmax,
    and no gradient)."""
    mask = batch.get("attention_mask")
    logits = logits.float()
    return logits if mask is None else logits.masked_fill(mask == 0, float("-inf"))
