"""engine/cache_dir.py's `cache_lock` between real processes, and what it is for: processes that start together
build a cache entry once (the GGUF tokenizer conversion here; the C kernels take the same lock)."""

import os
import subprocess
import sys
import textwrap

from test_gguf import write_gguf_from_hf

HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from engine.cache_dir import cache_lock
    with cache_lock("probe"):
        print("locked", flush=True)
        time.sleep(0.5)  # long enough for the parent to reach its own cache_lock meanwhile
        with open(sys.argv[1], "a") as out:
            out.write("child\\n")
""")

LOAD_TOKENIZER = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
    from engine.tokenizer import Tokenizer
    print(Tokenizer.from_path(sys.argv[1]).encode("Hello world"), flush=True)
""")


def _env(cache_dir):
    return dict(os.environ, DUET_CACHE_DIR=str(cache_dir), PYTHONPATH=os.getcwd())


def test_a_held_cache_lock_makes_another_process_wait(tmp_path, monkeypatch):
    from engine.cache_dir import cache_lock

    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path / "cache"))
    order = tmp_path / "order.txt"
    child = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(order)], stdout=subprocess.PIPE, text=True,
                             env=_env(tmp_path / "cache"))
    assert child.stdout.readline().strip() == "locked"
    with cache_lock("probe"):  # granted only once the child has written and left its block
        with open(order, "a") as out:
            out.write("parent\n")
    assert child.wait(timeout=30) == 0
    assert order.read_text() == "child\nparent\n"
    assert (tmp_path / "cache" / "locks" / "probe.lock").is_file()


def test_processes_loading_a_gguf_together_convert_its_tokenizer_once(tiny_llama_dir, tmp_path):
    path = write_gguf_from_hf(tiny_llama_dir, tmp_path / "tiny.gguf", "llama", quantize_matrices=False)
    procs = [subprocess.Popen([sys.executable, "-c", LOAD_TOKENIZER, str(path)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=_env(tmp_path / "cache")) for _ in range(3)]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0], outputs
    assert sum(out.count("converting the tokenizer of") for out in outputs) == 1, outputs
    assert len({out.strip().splitlines()[-1] for out in outputs}) == 1, outputs  # the same ids everywhere
    assert len(list((tmp_path / "cache" / "tokenizers").glob("*.json"))) == 1
