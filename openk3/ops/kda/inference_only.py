"""The check every inference-only KDA form makes first: under autograd it says how to choose a differentiable form, rather
than run in-place updates autograd rejects, or a kernel that drops the gradient."""

from __future__ import annotations

import torch


def refuse_autograd(form: str, x: torch.Tensor) -> None:
    if torch.is_grad_enabled() and x.requires_grad:
        raise RuntimeError(
            f"the KDA form {form!r} is inference-only; for training select the differentiable forms (model.select_ops("
            "target=OpTarget(training=True)), or OpChoice(kda='autograd') / 'naive' by name), or run under torch.no_grad()"
        )
