"""Planning: which split, ZeRO stage, tensor parallel size and `max_staleness` to run, predicted before running.

`model_shapes.py` (a model's shape from its config or size), `hardware.py` (device profiles, analytical or
measured), `cost_model.py` (seconds per stage and bytes per device), `simulator.py` (a discrete-event simulation of
our pipeline), `search.py` (every plan, ranked), `commands.py` (the command that runs a plan), `feedback.py` (the
end-of-run comparison in `trainers/run_summary.py`), `config/cli.py` (`python -m async_rlhf.plan`). docs/planning.md.
"""


def __getattr__(name):  # `async_rlhf.plan.main` (what `python -m async_rlhf.plan` runs), imported on first use
    if name == "main":
        from importlib import import_module

        return import_module("async_rlhf.plan.cli").main
    raise AttributeError(f"module 'async_rlhf.plan' has no attribute {name!r}")
