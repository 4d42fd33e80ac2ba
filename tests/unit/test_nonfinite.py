"""NonFiniteGuard with a tiny real model and a real AdamW step: a non-finite loss or gradient norm drops the step's
gradients so `optimizer.step()` leaves the weights and the optimizer state as they were; finite steps reset the
count; more than `max_nonfinite_steps` in a row raise naming the field and both numbers."""

import math

import pytest
import torch
from accelerate import Accelerator

from async_rlhf.data.tiny_model import char_tokenizer, tiny_llama
from async_rlhf.learner.nonfinite import NonFiniteGuard, NonFiniteSteps


def step(model, optimizer, guard, scale: float) -> bool:
    """One optimizer step as the Trainer takes it: backward, clip (norm), guard, step."""
    ids = torch.tensor([[1, 2, 3, 4]])
    loss = model(input_ids=ids, labels=ids).loss * scale
    guard.note_loss(loss)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    skipped = guard.check_step(norm, model, optimizer)
    optimizer.step()
    optimizer.zero_grad()
    return skipped


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_nonfinite_steps_leave_the_policy_and_optimizer_untouched_then_stop():
    torch.manual_seed(0)
    model = tiny_llama(char_tokenizer())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    guard = NonFiniteGuard(limit=2, accelerator=Accelerator(cpu=True))

    assert step(model, optimizer, guard, 1.0) is False  # a normal step moves the weights
    before, adam_before = snapshot(model), {k: v["step"].clone() for k, v in optimizer.state.items()}
    assert step(model, optimizer, guard, math.nan) is True  # NaN loss (and so NaN norm): skipped
    assert step(model, optimizer, guard, math.inf) is True  # inf loss: skipped
    after = snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # weight decay did not touch them either
    assert all(torch.equal(adam_before[k], v["step"]) for k, v in optimizer.state.items())
    assert (guard.total, guard.in_a_row) == (2, 2)

    assert step(model, optimizer, guard, 1.0) is False  # a finite step resets the run of bad ones
    assert guard.in_a_row == 0 and not all(torch.equal(after[k], v) for k, v in snapshot(model).items())

    for _ in range(2):
        assert step(model, optimizer, guard, math.nan) is True
    with pytest.raises(NonFiniteSteps, match=r"learner: 3 optimizer steps in a row had a non-finite loss or gradient "
                                             r"norm .* more than max_nonfinite_steps=2"):
        step(model, optimizer, guard, math.nan)
    assert guard.total == 5
    assert all(torch.isfinite(v).all() for v in snapshot(model).values())


def test_a_finite_loss_with_a_non_finite_gradient_norm_is_skipped():
    model = tiny_llama(char_tokenizer())
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    guard = NonFiniteGuard(limit=0, accelerator=Accelerator(cpu=True))
    before = snapshot(model)
    next(model.parameters()).grad = torch.full_like(next(model.parameters()), math.inf)
    with pytest.raises(NonFiniteSteps, match="1 optimizer steps in a row .*last gradient norm: inf.* "
                                             "max_nonfinite_steps=0"):
        guard.check_step(torch.tensor(math.inf), model, optimizer)
    optimizer.step()  # what the Trainer would have done had it not stopped: nothing to apply
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in snapshot(model).items())
