"""Weight directories left in shared memory by a SIGKILLed run are removed by the next run."""

import os
import subprocess
import sys

from async_rlhf.weight_sync.shm import ShmWeightTransport, remove_orphaned_dirs


def test_orphaned_weight_dirs_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    orphan = tmp_path / f"async_rlhf-weights-pid{dead_pid}-abc"
    orphan.mkdir()
    (orphan / "v1.safetensors").write_bytes(b"x")
    alive = tmp_path / f"async_rlhf-weights-pid{os.getpid()}-def"
    alive.mkdir()
    unrelated = tmp_path / "async_rlhf-weights-old"  # no owner recorded: left alone
    unrelated.mkdir()
    transport = ShmWeightTransport(str(tmp_path))
    try:
        assert not orphan.exists()
        assert alive.exists() and unrelated.exists()
        assert os.path.basename(transport.dir).startswith(f"async_rlhf-weights-pid{os.getpid()}-")
        assert remove_orphaned_dirs(str(tmp_path)) == []  # its own directory is alive
    finally:
        transport.close()
