"""Kill a generator while rank 0 sends a version's bytes over the network transport (after every member voted for
the version): the network weight tests' fault."""

from __future__ import annotations


def train_killing_mid_broadcast(trainer, kill, monkeypatch) -> list[int]:
    """Train `trainer`, calling `kill(trainer)` once, as rank 0 starts sending a version's bytes after the first
    optimizer step; returns the step it was called at ([] if never)."""
    from async_rlhf.weight_sync import broadcast

    send_packed, killed = broadcast.send_packed, []

    def kill_then_send(group, tensors, bucket_bytes):
        if not killed and trainer.state.global_step >= 1:
            kill(trainer)
            killed.append(trainer.state.global_step)
        return send_packed(group, tensors, bucket_bytes)

    monkeypatch.setattr(broadcast, "send_packed", kill_then_send)
    trainer.train()
    return killed
