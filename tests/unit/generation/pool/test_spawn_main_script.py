"""A spawned generator process does not import the parent's main script again (`processes.main_script_hidden`),
unless what it unpickles names a class of that script; the parent's main module is unchanged after `start`."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import os, sys
    print("main script imported as", __name__, flush=True)
    from async_rlhf.generation.pool.processes import GeneratorProcess

    class FromMain:
        pass

    def first_arg_kind(spec, inbox, outbox):
        print("child got", type(spec).__name__, flush=True)

    targets = {"plain": print, "main_class": print, "main_target": first_arg_kind}

    if __name__ == "__main__":
        kind = sys.argv[1]
        spec = FromMain() if kind == "main_class" else {"plain": 1}
        file_before, spec_before = __file__, __spec__
        p = GeneratorProcess(target=targets[kind], args=(spec, None, None))
        p.start()
        p.join(60)
        assert p.exitcode == 0, p.exitcode
        assert (__file__, __spec__) == (file_before, spec_before)
        print("parent main unchanged", flush=True)
''')


def run_probe(tmp_path, kind: str) -> list[str]:
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(path), kind], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.splitlines()


def test_a_generator_process_does_not_import_the_main_script_again(tmp_path):
    lines = run_probe(tmp_path, "plain")
    assert lines.count("main script imported as __main__") == 1
    assert not any("__mp_main__" in line for line in lines), lines
    assert "{'plain': 1} None None" in lines  # the child ran its target
    assert "parent main unchanged" in lines


def test_a_spec_or_target_of_the_main_script_still_gets_it(tmp_path):
    lines = run_probe(tmp_path, "main_class")
    assert "main script imported as __mp_main__" in lines
    assert any(line.startswith("<__mp_main__.FromMain object") for line in lines), lines
    assert "parent main unchanged" in lines
    lines = run_probe(tmp_path, "main_target")
    assert "main script imported as __mp_main__" in lines
    assert "child got dict" in lines
