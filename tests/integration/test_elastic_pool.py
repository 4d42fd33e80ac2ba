"""A generator joins and leaves a running pool (`experimental/elastic_pool.py`: `add_generator` / `retire_generator`), with real
generator processes (transformers backend, tiny model) or Ray actors (slow tier; skipped without Ray):

* a joining generator takes no request until it is ready, and before its first request it loads the newest weights,
  including an update published while it was starting (held back, then sent when it became ready);
* a retiring generator leaves `active_generators()` at once, but gets `Shutdown` only after answering the request
  it holds: the answer arrives (nothing lost), once (nothing duplicated), and then its process is gone.
"""

from __future__ import annotations

import queue
import time

import pytest

from async_rlhf.data.tiny_model import char_tokenizer, tiny_llama
from async_rlhf.experimental.elastic_pool import ElasticGeneratorPool
from async_rlhf.generation.engine.worker import GeneratorSpec
from async_rlhf.types import GenerationRequest, SamplingSettings
from async_rlhf.weight_sync import ShmWeightTransport

SETTINGS = SamplingSettings(max_new_tokens=24, temperature=1.0, n=2, seed=0)


def _spec(gid: int, model_dir: str, log_dir) -> GeneratorSpec:
    return GeneratorSpec(generator_id=gid, backend="transformers", model_path=model_dir, device="cpu", seed=gid,
                         threads=1, engine_kwargs={"dtype": "float32"}, log_path=str(log_dir / f"generator-{gid}.log"))


def _request(batch_id: int) -> GenerationRequest:
    return GenerationRequest(batch_id, [batch_id], [[2, 40 + batch_id, 41]], SETTINGS)


def _launcher(kind: str):
    if kind == "process":
        return None
    from async_rlhf.config.checks import RAY_INSTALL_HINT as INSTALL_HINT
    from async_rlhf.config.checks import ray_installed
    from async_rlhf.generation.pool.ray_launcher import RayLauncher

    if not ray_installed():
        pytest.skip(f"Ray is not installed (an optional extra: {INSTALL_HINT})")
    return RayLauncher()


@pytest.mark.slow  # an experimental schedule (experimental/elastic.py); the pool's add/retire is its only user
@pytest.mark.parametrize("launcher", ["process", "ray"])
def test_a_generator_joins_with_the_newest_weights_and_retires_without_losing_work(tmp_path, tiny_model_dir,
                                                                                    launcher):
    got: queue.Queue = queue.Queue()
    arrived: list = []
    transport = ShmWeightTransport(str(tmp_path))
    pool = ElasticGeneratorPool([_spec(0, tiny_model_dir, tmp_path)], got.put, start_timeout=300, weight_sync_timeout=300,
                         max_restarts=0, launcher=_launcher(launcher))

    def wait_for(done, what: str, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            pool.check()
            try:
                arrived.append(got.get(timeout=0.05))
            except queue.Empty:
                assert time.monotonic() < deadline, f"{what} within {timeout:.0f} s"

    def weights(version: int):
        return transport.publish(dict(tiny_llama(char_tokenizer(), seed=version).state_dict()), version)

    try:
        pool.start()
        pool.send_weights(weights(1))
        pool.add_generator(_spec(1, tiny_model_dir, tmp_path))
        assert pool.active_generators() == [0] and not pool.settled()  # no request goes to it while it starts
        pool.send_weights(weights(2))  # published while generator 1 starts: held back for it
        wait_for(lambda: pool.active_generators() == [0, 1], "generator 1 ready")
        for batch_id, gid in ((0, 0), (1, 1)):
            pool.send_request(gid, _request(batch_id))
        wait_for(lambda: len(arrived) == 2, "both answers")
        first = {r.generator_id: r for r in arrived}
        assert first[1].policy_version == 2, "the joining generator sampled before loading the newest weights"
        assert pool.acks.loaded_version == {0: 2, 1: 2}

        pool.send_request(1, _request(2))  # held by generator 1 when it is retired
        pool.retire_generator(1)
        assert pool.active_generators() == [0]
        wait_for(lambda: 1 in pool.retired, "generator 1 gone after answering")
        answers = [r for r in arrived if r.batch_id == 2]
        assert [(r.generator_id, r.policy_version) for r in answers] == [(1, 2)]  # once, from the retired one
        assert pool.processes[1].exitcode == 0  # it left on Shutdown, not killed
        assert 1 not in pool.acks.loaded_version  # nothing is awaited from it any more
        pool.send_weights(weights(3))  # the pool goes on with generator 0 alone
        pool.send_request(0, _request(3))
        wait_for(lambda: any(r.batch_id == 3 for r in arrived), "generator 0's answer after the retirement")
        assert pool.acks.loaded_version == {0: 3}
        assert pool.answered == {0: [2, 2], 1: [2, 2]}
    finally:
        pool.close()
        transport.close()
    assert all(p.exitcode is not None for p in pool.processes)
