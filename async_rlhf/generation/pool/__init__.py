"""Generators seen from learner rank 0: where they run and what they start from (`placement.py`, `backend_choice.py`,
`backend_probe.py`), how they are started early (`early_start.py`), the pools that start, feed, watch and restart
them (`local.py` with `processes.py` and `ray_launcher.py`; `http_pool.py` with `http_client.py` for servers), and
which pool and weight transport a run gets (`choice.py`)."""
