"""evals/sorting_sft_baseline.py keeps the other sizes' entries of an existing output file, so a size is added later
without evaluating the others again (the policies' evaluation itself is `tasks/evaluation.py`'s, tested there)."""

import json

from evals import sorting_sft_baseline


def test_a_new_size_is_added_to_the_file_and_the_others_kept(tmp_path, monkeypatch):
    path = tmp_path / "sft_baseline.json"
    path.write_text(json.dumps({"default": {"gold_reward": 1.06}, "small": {"gold_reward": 1.04}}))
    monkeypatch.setattr(sorting_sft_baseline, "evaluate_sft", lambda size, num_prompts: {"gold_reward": 1.1})
    printed = sorting_sft_baseline.main(["--sizes", "large", "small", "--output_file", str(path)])
    assert printed == {"large": {"gold_reward": 1.1}, "small": {"gold_reward": 1.1}}
    assert json.loads(path.read_text()) == {"default": {"gold_reward": 1.06}, "small": {"gold_reward": 1.1},
                                            "large": {"gold_reward": 1.1}}
