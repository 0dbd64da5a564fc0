"""utils.compile_cache: cold blocks really compile from nothing, restore the environment, and count hits."""

import os

import pytest
import torch

from utils import compile_cache


def test_graph_counts_subtract_and_read():
    counts = compile_cache.GraphCounts(compiled=3, loaded=2) - compile_cache.GraphCounts(compiled=1, loaded=2)
    assert counts == compile_cache.GraphCounts(2, 0)
    assert str(counts) == "2 compiled, 0 from cache"


def test_cold_points_both_caches_at_a_new_empty_directory_and_restores_them(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    with compile_cache.cold() as cache:
        assert cache.directory.is_dir() and not any(cache.directory.iterdir())
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache.directory)
        assert os.environ["TRITON_CACHE_DIR"].startswith(str(cache.directory))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert "TRITON_CACHE_DIR" not in os.environ, "a variable that was unset must be unset again"
    assert not cache.directory.exists(), "the directory is deleted unless keep=True"
    with compile_cache.cold(keep=True, parent=tmp_path) as kept:
        pass
    assert kept.directory.is_dir() and kept.directory.parent == tmp_path


def test_cold_restores_the_environment_after_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="inside"), compile_cache.cold():
        raise RuntimeError("inside")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)


def test_missing_parent_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"), compile_cache.cold(parent=tmp_path / "no"):
        pass


def test_cold_compiles_warm_reuses_and_a_new_cold_block_compiles_again():
    """The behaviour that matters: inside one block a recompile after reset loads the graph from the block's
    cache; a second block starts from nothing although this process compiled the same graph before."""

    def fn(x):
        return torch.sin(x) * 2 + 1

    x = torch.randn(16)
    with compile_cache.cold() as cache:
        torch.compile(fn)(x)
        assert cache.counts() == compile_cache.GraphCounts(1, 0)
        assert cache.files(), "the compile wrote into the block's directory"
        torch.compiler.reset()
        torch.testing.assert_close(torch.compile(fn)(x), fn(x))
        assert cache.status() == "1 compiled, 1 from cache"
    with compile_cache.cold() as again:
        torch.compile(fn)(x)
        assert again.counts() == compile_cache.GraphCounts(1, 0), "a new cold block must not reuse the graph"


def test_quiesce_shuts_the_compile_workers_down_and_compiled_code_keeps_working():
    import torch._inductor.async_compile as async_compile

    def fn(x):
        return torch.cos(x) * 3 - 1

    x = torch.randn(16)
    with compile_cache.cold() as cache:
        compiled = torch.compile(fn)
        compiled(x)
    before = compile_cache.graph_counts()
    compile_cache.quiesce()
    assert not async_compile._pool_set, "every compile-worker pool shut down"
    torch.testing.assert_close(compiled(x), fn(x))
    assert compile_cache.graph_counts() == before, "the compiled function ran without compiling again"
    assert cache.counts().compiled >= 1
    compile_cache.quiesce()  # twice in a row: nothing left to shut down, no error


def test_keep_compiled_compiles_cold_and_keeps_what_was_compiled_before():
    """Variants compiled one after another, each cold, stay compiled for a comparison timed after them all."""

    def first(x):
        return torch.tanh(x) + 1

    def second(x):
        return torch.tanh(x) * 3

    x = torch.randn(16)
    with compile_cache.cold():
        compiled_first = torch.compile(first)
        compiled_first(x)
    with compile_cache.cold(keep_compiled=True) as cache:
        torch.compile(second)(x)
        assert cache.counts() == compile_cache.GraphCounts(1, 0), "the new function compiled from nothing"
        before = compile_cache.graph_counts()
        torch.testing.assert_close(compiled_first(x), first(x))
        assert compile_cache.graph_counts() == before, "the function compiled before the block did not compile again"
    with compile_cache.cold():
        before = compile_cache.graph_counts()
        compiled_first(x)
        assert (compile_cache.graph_counts() - before).compiled == 1, "a default block forgets earlier compiles"


def test_size_bytes_sums_the_files_and_counts_one_that_vanished_as_zero(tmp_path, monkeypatch):
    cache = compile_cache.ColdCache(tmp_path)
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"x" * 5)
    assert cache.size_bytes() == 15
    gone = tmp_path / "gone"
    monkeypatch.setattr(compile_cache.ColdCache, "files", lambda self: [tmp_path / "a", gone])
    assert cache.size_bytes() == 10, "a file a compile worker removed meanwhile counts as 0"
