"""Directories a run keeps in shm_dir (weights, the generators' initial copy) are removed once their owner is gone,
and never while it lives, whatever its pid means here (a /dev/shm shared between containers holds directories of
runs in other pid namespaces). Ownership is an flock on `owner.lock` inside the directory
(`weight_sync/shm_dirs.py`)."""

import fcntl
import os
import signal
import subprocess
import sys
import types

from async_rlhf.weight_sync.shm import ShmWeightTransport, remove_orphaned_dirs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOCK_NAME = "owner.lock"  # the file an owner keeps flock-ed (shm_dirs.LOCK_NAME)


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def _run_dir(parent, name: str, lock_file: bool = True):
    path = parent / name
    path.mkdir()
    (path / "policy-v1.safetensors").write_bytes(b"x")
    if lock_file:
        (path / LOCK_NAME).write_text("")
    return path


def _hold_lock(path) -> int:
    """Lock `path`'s lock file as its owner does (a separate open file description: it conflicts like another
    process's would)."""
    fd = os.open(path / LOCK_NAME, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_lock_file_name_is_the_one_the_owner_locks():
    from async_rlhf.weight_sync import shm_dirs

    assert shm_dirs.LOCK_NAME == LOCK_NAME


def test_directories_whose_owner_holds_the_lock_survive_whatever_their_pid_says(tmp_path):
    # the names old versions gave: a pid of a process that does not exist here (dead, or in another pid namespace)
    weights = _run_dir(tmp_path, f"async_rlhf-weights-pid{_dead_pid()}-abc")
    init = _run_dir(tmp_path, "async_rlhf-init-def")
    fds = [_hold_lock(weights), _hold_lock(init)]
    try:
        assert remove_orphaned_dirs(str(tmp_path)) == []
        assert weights.exists() and init.exists()
    finally:
        for fd in fds:
            os.close(fd)
    assert sorted(remove_orphaned_dirs(str(tmp_path))) == sorted([str(init), str(weights)])  # the owner is gone


def test_unlocked_directories_are_removed_and_unowned_ones_left_alone(tmp_path):
    orphans = [_run_dir(tmp_path, f"async_rlhf-weights-pid{os.getpid()}-abc"),  # a live pid, but nobody's lock
               _run_dir(tmp_path, "async_rlhf-weights-xyz"), _run_dir(tmp_path, "async_rlhf-init-xyz")]
    no_lock_file = _run_dir(tmp_path, "async_rlhf-weights-old", lock_file=False)  # older version: not provably dead
    unrelated = _run_dir(tmp_path, "someone-else")
    removed = remove_orphaned_dirs(str(tmp_path))
    assert sorted(removed) == sorted(str(p) for p in orphans)
    assert not any(p.exists() for p in orphans)
    assert no_lock_file.exists() and unrelated.exists()


def test_directories_of_a_killed_owner_are_removed_by_the_next_transport(tmp_path):
    # a run killed with SIGKILL: its weight directory and its initial copy stay, locked by nobody
    code = ("import sys, time\n"
            "from async_rlhf.weight_sync.shm_dirs import INIT_PREFIX, WEIGHTS_PREFIX, OwnedDir\n"
            "dirs = [OwnedDir(sys.argv[1], WEIGHTS_PREFIX), OwnedDir(sys.argv[1], INIT_PREFIX)]\n"
            "print(*[d.path for d in dirs], flush=True)\n"
            "time.sleep(600)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    owner = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        paths = owner.stdout.readline().split()
        assert len(paths) == 2 and all(os.path.isdir(p) for p in paths), paths
        assert remove_orphaned_dirs(str(tmp_path)) == []  # the owner lives
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        owner.stdout.close()
    transport = ShmWeightTransport(str(tmp_path))
    try:
        assert not any(os.path.exists(p) for p in paths)
        assert remove_orphaned_dirs(str(tmp_path)) == []  # the transport's own directory is locked
        assert os.path.isdir(transport.dir) and os.path.isfile(os.path.join(transport.dir, LOCK_NAME))
    finally:
        transport.close()
    assert not os.path.exists(transport.dir)
    assert sorted(os.listdir(tmp_path)) == []  # no hidden directory left from its creation either


def test_initial_copy_is_locked_made_on_rank_0_only_and_removed_on_close(tmp_path):
    from async_rlhf.data.tiny_model import char_tokenizer, tiny_llama
    from async_rlhf.generation.pool.placement import initial_model_dir

    tokenizer = char_tokenizer()
    model = tiny_llama(tokenizer)
    other_rank = types.SimpleNamespace(is_main_process=False, unwrap_model=lambda m: m)
    assert initial_model_dir(None, model, tokenizer, other_rank, str(tmp_path)) == ("", None)
    assert os.listdir(tmp_path) == []  # ranks 1..n-1 used to leave an empty async_rlhf-init-* each

    rank0 = types.SimpleNamespace(is_main_process=True, unwrap_model=lambda m: m)
    path, copy = initial_model_dir(None, model, tokenizer, rank0, str(tmp_path))
    try:
        assert os.path.basename(path).startswith("async_rlhf-init-")
        assert os.path.isfile(os.path.join(path, "config.json"))
        assert remove_orphaned_dirs(str(tmp_path)) == []  # locked while the run lives
    finally:
        copy.close()
    assert not os.path.exists(path)

