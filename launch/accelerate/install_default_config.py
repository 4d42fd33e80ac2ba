"""Give accelerate a default config (`launch/accelerate/default_config.yaml`: one learner process) unless the user
already has one; run by `scripts/install.sh`.

    python launch/accelerate/install_default_config.py

Without a default config, `accelerate launch recipes/online_dpo.py` runs, but first lists the four launch settings
it defaulted (among them "`--num_processes` was set to a value of `0`" on a CPU machine). An existing default
config (`accelerate config` writes one) is never touched. Where it goes follows accelerate: `$HF_HOME/accelerate/`,
by default `~/.cache/huggingface/accelerate/`.
"""

from __future__ import annotations

import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OURS = os.path.join(HERE, "default_config.yaml")


def main() -> int:
    from accelerate.commands.config.config_args import default_config_file, default_yaml_config_file

    if os.path.isfile(default_config_file):
        print(f"accelerate: default config kept ({default_config_file})")
        return 0
    os.makedirs(os.path.dirname(default_yaml_config_file), exist_ok=True)
    shutil.copyfile(OURS, default_yaml_config_file)
    print(f"accelerate: default config written to {default_yaml_config_file} (one learner process; "
          "`accelerate config` replaces it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
