"""A continuous-batching engine for tests that need a sample still running when a weight update arrives: the tiny
policy made slow (a pause per forward: transformers' decode loop runs on its own, as fast as it can, whatever the
serve loop does) and unable to end on EOS (its logit set to `NO_EOS`), so that a sample lasts its whole budget. The
tests compute reference log-probs with the same logit (`without_eos`)."""

from __future__ import annotations

import time

from async_rlhf.experimental.continuous_batching import ContinuousBatchingEngine

EOS = 1  # the char tokenizer's
NO_EOS = -1.0e4
PAUSE = 0.01  # seconds per forward: a 200-token sample takes 2 s or more


def without_eos(logits):
    """`logits` (any shape [..., V]) with EOS made (almost) impossible, in place; returns it."""
    logits[..., EOS] = NO_EOS
    return logits


class SlowEngine(ContinuousBatchingEngine):
    @classmethod
    def make_backend(cls, kind, model_path, device, seed, engine_kwargs):
        backend = super().make_backend(kind, model_path, device, seed, engine_kwargs)

        def slow_and_endless(module, inputs, output):
            time.sleep(PAUSE)
            without_eos(output.logits)
            return output

        backend.model.register_forward_hook(slow_and_endless)
        return backend
