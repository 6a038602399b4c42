"""Portable torch.compile artifacts: saved once, loaded before compiling; anything wrong means compiling, said once."""

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

from labkit import train as T
from labkit.bench import compile_cache, unwritable
from labkit.env import LabkitError
from labkit.faststart import compile_artifacts as CA
from labkit.faststart import precompiled as P
from labkit.faststart import warmstart


@pytest.fixture
def fake_saved(monkeypatch):
    """save() with torch's packer replaced: a small blob, no compiling (a CPU compile takes many seconds)."""
    from torch.compiler._cache import CacheInfo

    info = CacheInfo()
    info.artifacts["inductor"] += ["k1", "k2"]
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"compiled graphs" * 10, info))


@pytest.fixture
def inductor():
    """torch._inductor.config, its compile_threads restored after the test (a load sets it)."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(compile_threads=inductor_config.compile_threads):
        yield inductor_config


def _other_file(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("not a folder")
    return f / "cache"  # nothing, not even root, can create a folder inside a file


def test_an_artifact_saved_after_compiling_is_loaded_by_a_fresh_cache_and_compiles_nothing(tmp_path, lines):
    from torch._dynamo.utils import counters

    got, say = lines
    a = torch.randn(4, 4)
    with compile_cache(tmp_path / "first"):  # a matmul only: inductor calls the library, no C++ kernel to build
        torch.compile(lambda x: x @ x.T)(a)
        path = CA.save("cpu", tmp_path / "art", note={"rungs": ["tiny"]}, say=say)
    assert path == CA.artifact_path("cpu", tmp_path / "art") and torch.__version__ in path.name
    assert CA.check("cpu", tmp_path / "art")[0] == "ok" and not got
    counters.clear()
    with compile_cache(tmp_path / "second"):  # empty: what a fresh machine has
        rec = CA.load("cpu", tmp_path / "art", say=say)
        torch.compile(lambda x: x @ x.T)(a)
    assert rec["entries"]["inductor"] >= 1 and rec["path"] == str(path)
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1 and not counters["inductor"]["fxgraph_cache_miss"]
    assert got == [f"compile cache: loaded {sum(rec['entries'].values())} cached graphs and kernels from {path}"]
    assert rec["compile_workers"] is True  # the caller named no graphs: nothing says the artifact covers the run


def test_a_run_the_artifact_covers_compiles_in_the_process_without_workers(tmp_path, lines, fake_saved,
                                                                         monkeypatch, inductor):
    """Every kernel is in the artifact: a worker pool would only slow the first step and the exit
    (cold_start_workers.json). A graph it lacks keeps the pool (one thread compiles it far slower), and
    TORCHINDUCTOR_COMPILE_THREADS, set by the user, wins."""
    from torch.compiler._cache import CacheInfo

    got, say = lines
    mine, other = T.graph_key(T.preset("muon")), T.graph_key(T.preset("muon", T.quick_base()))
    path = CA.save("cpu", tmp_path, note={"graphs": [mine]}, say=say)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda blob: CacheInfo())
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    inductor.compile_threads = 8
    plain = f"compile cache: loaded 0 cached graphs and kernels from {path}"
    for graphs in (None, [other], [mine, other]):
        assert CA.load("cpu", tmp_path, say=say, graphs=graphs)["compile_workers"] is True
        assert inductor.compile_threads == 8 and got.pop() == plain
    assert CA.load("cpu", tmp_path, say=say, graphs=[mine])["compile_workers"] is False
    assert inductor.compile_threads == 1
    assert got.pop() == plain + " (compiling in this process: TORCHINDUCTOR_COMPILE_THREADS=N starts N workers)"
    inductor.compile_threads = 8
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "8")
    assert CA.load("cpu", tmp_path, say=say, graphs=[mine])["compile_workers"] is True
    assert inductor.compile_threads == 8 and got.pop() == plain


def test_autotuning_results_go_where_the_cached_kernels_look_for_them(tmp_path, lines, monkeypatch):
    """torch restores a cached kernel with the path it was compiled at on the building machine and reads its
    autotuning result from that folder: the load copies the artifact's results there too, and only results."""
    from torch.compiler._cache import CacheInfo

    got, say = lines
    built_in = tmp_path / "build-machine" / "labkit-compile-x"
    keys = ["kl/ab12.best_config", "3n/cd34.best_config"]
    hostile = ["../../evil.best_config", "kl/x.py", "/etc/y.best_config"]

    def fake_load(blob):  # what torch does: each result under this machine's cache folder, under its key
        for k in keys + hostile[:2]:
            dst = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"], k)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(f'{{"XBLOCK": 1024, "key": "{k}"}}')
        info = CacheInfo()
        info.artifacts["autotune"] += ["aa/gone.best_config"] + keys + hostile  # listed first, never written: skipped
        return info

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"graphs" * 10, CacheInfo()))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", fake_load)
    CA.save("cpu", tmp_path / "art", note={"kernels_in": str(built_in)}, say=say)
    with compile_cache(tmp_path / "here") as here:
        rec = CA.load("cpu", tmp_path / "art", say=say)
    assert rec["autotune_placed"] == 2
    for k in keys:
        assert (built_in / k).read_text() == (Path(here) / k).read_text()
    placed = sorted(str(f.relative_to(tmp_path)) for f in tmp_path.rglob("*") if f.is_file() and "build-" in str(f))
    assert placed == [f"build-machine/labkit-compile-x/{k}" for k in sorted(keys)]  # nothing outside, no .py
    CA.save("cpu", tmp_path / "art", note={"kernels_in": str(_other_file(tmp_path))}, say=say)
    with compile_cache(tmp_path / "again"):  # a folder this machine cannot write: loaded all the same
        assert CA.load("cpu", tmp_path / "art", say=say)["autotune_placed"] == 0
    CA.save("cpu", tmp_path / "art", say=say)  # an artifact from before: nothing recorded, nothing placed
    with compile_cache(tmp_path / "old"):
        assert CA.load("cpu", tmp_path / "art", say=say)["autotune_placed"] == 0


def _rewrite(path, **header_changes):
    blob = path.read_bytes()
    header, payload = CA._unpack(blob)
    path.write_bytes(CA.MAGIC + json.dumps({**header, **header_changes}).encode() + b"\n" + payload)


@pytest.mark.parametrize("harm", ["flipped byte", "cut short", "not ours", "stale torch", "stale card", "folder"])
def test_a_broken_or_stale_artifact_is_skipped_with_one_line(tmp_path, lines, fake_saved, monkeypatch, harm):
    got, say = lines
    path = CA.save("cpu", tmp_path, say=say)
    called = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", called.append)
    if harm == "flipped byte":
        blob = bytearray(path.read_bytes())
        blob[-3] ^= 1
        path.write_bytes(bytes(blob))
    elif harm == "cut short":
        path.write_bytes(path.read_bytes()[:-5])
    elif harm == "not ours":
        path.write_bytes(b"\x80\x04garbage")
    elif harm == "stale torch":
        _rewrite(path, torch="2.0.0")
    elif harm == "stale card":
        _rewrite(path, card="NVIDIA H100 80GB HBM3 sm90")
    else:  # a folder where the file should be: reading it fails even as root
        path.unlink()
        path.mkdir()
    assert CA.load("cpu", tmp_path, say=say) is None and not called  # torch never saw the bytes
    state = {"stale torch": "stale", "stale card": "stale", "folder": "unreadable"}.get(harm, "corrupt")
    assert len(got) == 1 and got[0].startswith(f"compile cache {path} is {state} (")
    assert got[0].endswith("): compiling from scratch")
    if harm == "stale torch":
        assert f"built for torch '2.0.0', not '{torch.__version__}'" in got[0]


def test_no_artifact_is_silent_unless_one_exists_for_another_torch(tmp_path, lines, fake_saved):
    got, say = lines
    assert CA.load("cpu", tmp_path, say=say) is None and got == []
    path = CA.save("cpu", tmp_path, say=say)
    old = path.with_name(path.name.replace(CA._slug(torch.__version__), "2.0.0"))
    path.rename(old)
    assert CA.load("cpu", tmp_path, say=say) is None
    assert got == [f"compile cache: none for {CA.card('cpu')}, torch {torch.__version__} in {tmp_path} "
                   f"(only {old.name} (other torch versions)): compiling from scratch"]


def test_torch_failing_to_load_or_an_unwritable_cache_folder_falls_back_to_compiling(tmp_path, lines, fake_saved,
                                                                                    monkeypatch):
    got, say = lines
    path = CA.save("cpu", tmp_path, say=say)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda blob: None)  # torch's own unpickling failed
    assert CA.load("cpu", tmp_path, say=say) is None
    assert got.pop() == f"compile cache {path} is corrupt (torch could not unpack it): compiling from scratch"

    def no_space(blob):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", no_space)
    assert CA.load("cpu", tmp_path, say=say) is None
    assert got.pop().endswith("failed (No space left on device): compiling from scratch")

    blocked = _other_file(tmp_path)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocked))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the replacement folder lands in tmp_path
    assert CA.load("cpu", tmp_path, say=say) is None and len(got) == 1
    assert got[0].startswith(f"compile cache: torch.compile's cache folder {blocked} cannot be written (")
    assert got[0].endswith(f"compiling from scratch in {os.environ['TORCHINDUCTOR_CACHE_DIR']}")
    assert unwritable(os.environ["TORCHINDUCTOR_CACHE_DIR"]) is None  # torch.compile can work there


def test_saving_says_why_nothing_was_written(tmp_path, lines, fake_saved, monkeypatch):
    got, say = lines
    blocked = _other_file(tmp_path)
    assert CA.save("cpu", blocked, say=say) is None
    assert got.pop().startswith(f"compile cache: {blocked} cannot be written (")
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    assert CA.save("cpu", tmp_path, say=say) is None
    assert got == ["compile cache: nothing was compiled in this process, so there is nothing to save"]
    assert list(tmp_path.iterdir()) == [tmp_path / "a-file"]  # no half-written artifact either


def test_an_unwritable_compile_cache_folder_becomes_a_temporary_one(tmp_path, capsys, monkeypatch):
    blocked = _other_file(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with compile_cache(blocked) as folder:
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == folder != str(blocked) and os.path.isdir(folder)
    assert not os.path.exists(folder) and os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"compile cache folder {blocked} cannot be written (")


def fake_info(blob):
    from torch.compiler._cache import CacheInfo

    info = CacheInfo()
    info.artifacts["inductor"] += ["k1", "k2"]
    return info


def test_the_cli_shows_the_artifact_and_the_training_commands_load_it(tmp_path, capsys, fake_saved, monkeypatch,
                                                                      inductor):
    from labkit.cli import main

    monkeypatch.setenv("LABKIT_COMPILE_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    assert main(["compile-cache", "--device", "cpu"]) == 1
    assert capsys.readouterr().out.strip() == f"{CA.artifact_path('cpu')}: absent"
    path = CA.save("cpu", note={"graphs": [T.graph_key(T.fit_rung(T.preset("compile"), torch.device("cpu"), False))]})
    assert main(["compile-cache", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith(f"{path}: ok\n  0.0 MB, built ")

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", fake_info)
    monkeypatch.setattr(T, "train", lambda cfg, dev, **kw: {"img_per_s": 1.0, "final_loss": 2.0, "accuracy": None})
    out = tmp_path / "train.json"
    assert main(["train", "--preset", "compile", "--device", "cpu", "--json", str(out)]) == 0
    assert (f"compile cache: loaded 2 cached graphs and kernels from {path} (compiling in this process"
            in capsys.readouterr().err)
    assert json.loads(out.read_text())["compile_cache"]["entries"] == {"inductor": 2}
    assert main(["train", "--preset", "compile", "--device", "cpu", "--set", "batch_size=64"]) == 0
    assert capsys.readouterr().err.endswith(f"from {path}\n")  # another graph: the workers stay
    assert main(["train", "--preset", "compile", "--device", "cpu", "--no-compile-cache"]) == 0
    assert main(["train", "--preset", "resident_data", "--device", "cpu"]) == 0  # eager: nothing to load
    assert "compile cache" not in capsys.readouterr().err
    ran = []
    monkeypatch.setattr(T, "run_ladder", lambda *a, **k: ran.append(k["names"]))
    assert main(["ladder", "--device", "cpu", "--rungs", "bf16,compile", "--full"]) == 0
    assert "compile cache: loaded" in capsys.readouterr().err and ran == [["bf16", "compile"]]
    assert main(["ladder", "--device", "cpu", "--rungs", "resident_data,compile"]) == 0  # quick CPU skips compile
    assert "compile cache" not in capsys.readouterr().err and ran[-1] == ["resident_data", "compile"]


def test_building_refuses_what_it_cannot_build_before_compiling(tmp_path):
    with pytest.raises(LabkitError, match="'bf16' is not a compiled rung"):
        warmstart.build("cpu", ["bf16"], folder=tmp_path)
    with pytest.raises(LabkitError, match="cannot be written"):
        warmstart.build("cpu", ["compile"], folder=_other_file(tmp_path))
    with pytest.raises(LabkitError, match="no rung can run on this device"):
        warmstart.build("cpu", ["cuda_graphs", "muon"], folder=tmp_path)


def test_a_built_artifact_names_the_graphs_it_holds_as_the_training_commands_will_ask(tmp_path, monkeypatch,
                                                                                     fake_saved):
    """`--build --set` records each rung's graph key with the changes applied: `labkit train` with the same
    --set finds its graph there and loads without compile workers."""
    trained, precompiled = [], []
    monkeypatch.setattr(T, "train", lambda cfg, dev, dataset=None: trained.append(cfg))
    monkeypatch.setattr(warmstart, "precompile", lambda cfg, dev, ds, folder, say: precompiled.append((cfg, folder)))
    path = warmstart.build("cpu", ["compile"], folder=tmp_path, sets=["batch_size=32", "epochs=9"],
                           log=lambda msg: None)
    header, _ = CA._unpack(path.read_bytes())
    assert header["note"]["graphs"] == [T.graph_key(trained[0])] and trained[0].batch_size == 32
    if P.supported():  # and the rung's forward saved whole beside it, for the same graph
        assert [(T.graph_key(c), f) for c, f in precompiled] == [(T.graph_key(trained[0]), tmp_path)]
    assert os.path.isabs(header["note"]["kernels_in"])  # where its kernels were compiled: they look there
    # what `labkit train --preset compile --set batch_size=32 epochs=3` compiles where bf16 runs natively (a GPU
    # from the A100 on; the ladder trains a CPU's bf16 rungs in its default precision): epochs change no graph
    cli = T.with_changes(T.preset("compile"), batch_size=32, epochs=3, precision=trained[0].precision)
    assert T.graph_key(cli) in header["note"]["graphs"]
