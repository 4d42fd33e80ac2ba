"""async_rlhf: asynchronous off-policy RLHF (Noukhovitch et al., arXiv 2410.18252).

Generator processes sample with vLLM and push rollouts tagged with their policy version into a
bounded-staleness queue; accelerate/DeepSpeed learners train on them and broadcast weights back.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncOnlineDPOTrainer": "async_rlhf.trainers.online_dpo",
    "AsyncOnlineDPOConfig": "async_rlhf.config.algorithms",
    "AsyncRLConfig": "async_rlhf.config.base",
    "AsyncRLOOTrainer": "async_rlhf.trainers.rloo",
    "AsyncRLOOConfig": "async_rlhf.config.algorithms",
    "AsyncPPOTrainer": "async_rlhf.trainers.ppo",
    "AsyncPPOConfig": "async_rlhf.config.algorithms",
    "AsyncBestOfNTrainer": "async_rlhf.trainers.best_of_n",
    "AsyncBestOfNConfig": "async_rlhf.config.algorithms",
    "AsyncGRPOTrainer": "async_rlhf.trainers.grpo",
    "AsyncGRPOConfig": "async_rlhf.config.algorithms",
}


def __getattr__(name):  # lazy: `import async_rlhf` stays cheap and never imports vLLM
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'async_rlhf' has no attribute {name!r}")
