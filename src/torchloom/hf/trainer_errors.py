"""Refusals of the torchloom functions ``TorchloomTrainer`` calls for its user, reworded for that user.

:func:`torchloom.hf.save_pretrained` ends a refusal with "Pass overwrite=True ..." and
:func:`torchloom.checkpoint.load` with "Pass strict=False ...": arguments of those functions, which
``TorchloomTrainer.save_model`` and ``train(resume_from_checkpoint=...)`` call with their defaults and do not
take. Under these context managers the same refusal ends with what a Trainer user can do instead.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torchloom.errors import CheckpointError


@contextlib.contextmanager
def save_model_advice(output_dir: str) -> Iterator[None]:
    """Inside ``TorchloomTrainer.save_model(output_dir)``: a ``save_pretrained`` refusal of a folder holding another
    model names the Trainer user's ways out (another ``output_dir``, deleting the folder, or
    ``torchloom.hf.save_pretrained(trainer.torchloom.model, dir, overwrite=True)``) instead of ``overwrite=True``.

    Raises:
        CheckpointError: the refusal, reworded (same class; other errors pass unchanged).
    """
    from torchloom.hf.save_target import OVERWRITE_ADVICE

    try:
        yield
    except CheckpointError as e:
        if OVERWRITE_ADVICE not in str(e):
            raise
        advice = (f"TorchloomTrainer.save_model does not replace another model: save into another directory "
                  f"(trainer.save_model(other_dir), or another TrainingArguments.output_dir), move that model's "
                  f"files out of {output_dir}, or replace that model's files (config, weights, adapter and tokenizer files; other files "
                  f"stay) with torchloom.hf.save_pretrained(trainer.torchloom.model, {str(output_dir)!r}, "
                  f"overwrite=True) on every rank.")
        raise type(e)(str(e).replace(OVERWRITE_ADVICE, advice)) from e


@contextlib.contextmanager
def resume_advice(checkpoint: str) -> Iterator[None]:
    """Inside ``TorchloomTrainer``'s resume from ``checkpoint``: a strict-load refusal (the model's trainable
    parameters or frozen base differ from the saving run's, or its keys do not match) names what a Trainer user can
    do instead of ``strict=False``, which ``train()`` does not take.

    Raises:
        CheckpointError: the refusal, reworded (same class; other errors pass unchanged).
    """
    from torchloom.checkpoint import trainable, trainer_state

    try:
        yield
    except CheckpointError as e:
        text = str(e)
        hints = [h for h in (trainable.STRICT_ADVICE, trainer_state.STRICT_ADVICE) if h in text]
        if not hints:
            raise
        advice = (f"TorchloomTrainer resumes strictly (train() takes no strict argument): build the model as the "
                  f"run that saved {checkpoint} built it (the same base weights, adapters and target modules), or "
                  f"train without resume_from_checkpoint to start afresh")
        for h in hints:
            text = text.replace(h, advice)
        raise type(e)(text) from e
