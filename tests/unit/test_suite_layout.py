"""The test folders have no `__init__.py`, so pytest imports each test module by its file name alone: two test files
with one name in different folders make the whole suite's collection fail ("import file mismatch"), which a run of
either folder alone does not show."""

import collections
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_file_name():
    names = collections.defaultdict(list)
    for path in TESTS.rglob("*.py"):
        names[path.name].append(str(path.relative_to(TESTS)))
    shared = {n: sorted(p) for n, p in names.items() if len(p) > 1 and n not in ("__init__.py", "conftest.py")}
    assert not shared, f"test modules that share a file name (rename one): {shared}"
