"""The tiered start (labkit.faststart.tiered): eager steps while the compiled forward loads or compiles beside the run, one
switch once it is ready, and nothing left behind: a child that is still compiling when the run ends is stopped,
its compile workers with it."""

import json
import os
import sys
import textwrap
import threading
import time
from dataclasses import asdict

import pytest
import torch
from torch import nn

from labkit import train as T
from labkit.bench import compile_cache
from labkit.env import LabkitError
from labkit.faststart import compile_artifacts as CA
from labkit.faststart import cudnn_warmup as CW
from labkit.faststart import precompiled as P
from labkit.faststart import tiered as TI

CPU = torch.device("cpu")
GRAPH = {"graph": 1}


@pytest.fixture
def anywhere(monkeypatch):
    """The tiered start on this CPU too (it applies on GPUs only)."""
    monkeypatch.setattr(TI, "applies", lambda cfg, dev, world_size=1: True)


def _tiny(**changes):
    return T.with_changes(T.quick_base(), width=4, n_train=96, n_test=32, batch_size=16, epochs=1, evaluate=False,
                          compile="default", **changes)


def test_steps_run_eager_until_the_forward_is_ready_then_it_runs_from_the_next_step(lines, monkeypatch):
    got, say = lines
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("torch.compile ran"))
    calls = []

    def loaded(model, x):  # a loaded forward: its own autocast inside, called outside the step's
        calls.append(torch.is_autocast_enabled("cpu"))
        return model(x)

    cfg = _tiny(precision="bf16")
    tier = TI.Tier(cfg, CPU, say)
    tier._fn = loaded
    rec = T.train(cfg, "cpu", tier=tier, on_step=lambda n: n == 2 and tier._ready.set())
    assert rec["steps"] == 6 and calls == [False] * 4 and all(map(torch.isfinite, torch.tensor(rec["losses"])))
    report = tier.close()
    assert report["eager_steps"] == 2 and report["compiled_steps"] == 4 and report["switch_step_s"] > 0
    assert not got and not report["stopped_compiling"]

    never = TI.Tier(cfg, CPU, say)  # a forward that never came: every step eager, the run complete
    never._ready.set()
    assert T.train(cfg, "cpu", tier=never)["steps"] == 6 and never.close()["compiled_steps"] == 0

    def unfit(model, x):  # its guards reject the run at the switch, before it computes anything
        raise RuntimeError("GuardManager check failed, reason: a size")

    refused = TI.Tier(cfg, CPU, say)
    refused._fn, refused.source = unfit, "saved forward"
    rec = T.train(cfg, "cpu", tier=refused, on_step=lambda n: n == 1 and refused._ready.set())
    report = refused.close()
    assert rec["steps"] == 6 and report["eager_steps"] == 6 and report["compiled_steps"] == 0
    assert report["source"] is None and len(rec["losses"]) == 6
    assert got == ["tiered start: the saved forward (labkit compile-cache) does not fit this run (GuardManager check "
                   "failed, reason: a size): rebuild it, or set LABKIT_PRECOMPILED=0; the run goes on eager"]


@pytest.mark.skipif(not P.supported(), reason="this torch cannot save compiled functions")
def test_a_saved_forward_loads_in_a_thread_and_is_handed_over_once_ready(tmp_path, lines, anywhere, inductor):
    got, say = lines
    cfg = _tiny()
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(10))
    x = torch.zeros(cfg.batch_size, 3, 8, 8)
    model(x)  # the lazy layer takes its shape
    with compile_cache(tmp_path / "cache"):
        assert P.build(cfg, model, x, GRAPH, tmp_path, say=say)
        tier = TI.start(cfg, CPU, GRAPH, tmp_path, say=say)
        tier._thread.join()
        fn = tier.forward()
        assert fn is not None and fn(model, x).shape == (cfg.batch_size, 10)
    report = tier.close()
    assert report["source"] == "saved forward" and report["ready_s"] > 0
    assert 0 <= report["import_s"] <= report["ready_s"] and 0 < report["load_s"] <= report["ready_s"]
    assert got == [f"precompiled forward: loaded {P.path_for(CPU, GRAPH, tmp_path).name} (the first step traces "
                   f"nothing)"]


def _child_script(tmp_path, body: str) -> list[str]:
    """TI.CHILD as a script: `spec` is the JSON the run hands its child."""
    script = tmp_path / "child.py"
    script.write_text("import json, sys\nspec = json.loads(sys.argv[1])\n" + textwrap.dedent(body))
    return [sys.executable, str(script)]


def test_without_a_file_a_child_compiles_it_and_the_run_loads_what_it_saved(tmp_path, lines, anywhere, monkeypatch):
    got, say = lines
    cfg = _tiny()
    header = {"card": CA.card(CPU), "torch": torch.__version__, "graph": GRAPH, "code": P.code_version()}
    monkeypatch.setattr(TI, "CHILD", _child_script(tmp_path, f"""
        from pathlib import Path
        from labkit.faststart import compile_artifacts as CA, precompiled as P
        from labkit.presets import TrainConfig
        assert TrainConfig(**spec["config"]).name == {cfg.name!r} and spec["device"] == "cpu"
        header = {{**{header!r}, "bytes": 5, "sha256": __import__("hashlib").sha256(b"saved").hexdigest()}}
        CA._write(P.path_for("cpu", spec["graph"], spec["folder"]), P.MAGIC, header, b"saved", print)
    """))
    loaded = []
    monkeypatch.setattr(P, "load_found", lambda cfg, path, payload, **kw: loaded.append(payload) or "forward")
    tier = TI.start(cfg, CPU, GRAPH, tmp_path, say=say)
    tier._thread.join()
    assert tier.forward() == "forward" and loaded == [b"saved"]
    assert P.path_for(CPU, GRAPH, tmp_path).exists()  # kept for every later run
    report = tier.close()
    assert report["source"] == "compiled beside the run" and not report["stopped_compiling"]
    assert got == [f"tiered start: compiling {cfg.name}'s forward beside the run (pid {tier._child.pid}); training "
                   f"eager meanwhile"]


def test_a_child_that_fails_costs_one_line_and_the_run_stays_eager(tmp_path, lines, anywhere, monkeypatch):
    got, say = lines
    monkeypatch.setattr(TI, "CHILD", _child_script(tmp_path, "print('CUDA out of memory'); sys.exit(3)"))
    tier = TI.start(_tiny(), CPU, GRAPH, tmp_path, say=say)
    tier._thread.join()
    assert tier.forward() is None and tier.close()["source"] is None
    assert got[1:] == ["tiered start: compiling the forward failed (CUDA out of memory): the run stays eager"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its parent is gone too
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_run_that_ends_first_stops_the_child_and_its_workers(tmp_path, lines, anywhere, monkeypatch):
    got, say = lines
    pids = tmp_path / "pids"
    monkeypatch.setattr(TI, "STOP_WAIT_S", 2.0)
    monkeypatch.setattr(TI, "CHILD", _child_script(tmp_path, f"""
        import os, signal, subprocess, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a child that ignores the polite stop: killed after
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{worker.pid}}")
        time.sleep(60)
    """))
    tier = TI.start(_tiny(), CPU, GRAPH, tmp_path, say=say)
    for _ in range(200):
        if pids.exists() and len(pids.read_text().split()) == 2:
            break
        time.sleep(0.05)
    child, worker = map(int, pids.read_text().split())
    t0 = time.perf_counter()
    report = tier.close()
    assert time.perf_counter() - t0 < 10 and report["stopped_compiling"] and report["source"] is None
    assert not _alive(child)
    for _ in range(100):  # the worker, orphaned by its parent's death, is reaped by init
        if not _alive(worker):
            break
        time.sleep(0.05)
    assert not _alive(worker)
    assert got[-1] == ("tiered start: the run ended before its compiled forward was ready: stopped compiling it "
                       "(`labkit compile-cache --build` compiles it once for every later run)")
    assert tier.forward() is None and not tier._thread.is_alive()


def test_an_unwritable_cache_folder_gets_a_folder_of_the_run_removed_at_the_end(tmp_path, lines, anywhere,
                                                                                   monkeypatch):
    got, say = lines
    (tmp_path / "file").write_text("a file, not a folder")
    seen = tmp_path / "seen"
    monkeypatch.setattr(TI, "CHILD", _child_script(tmp_path, f"open({str(seen)!r}, 'w').write(spec['folder'])"))
    tier = TI.start(_tiny(), CPU, GRAPH, tmp_path / "file" / "cache", say=say)
    tier._thread.join()
    own = seen.read_text()
    assert os.path.basename(own).startswith("labkit-tiered-") and os.path.isdir(own)
    assert got[0].startswith(f"tiered start: {tmp_path / 'file' / 'cache'} cannot be written (")
    assert got[0].endswith(f"): the compiled forward goes to {own}, for this run only")
    tier.close()
    assert not os.path.exists(own)


def test_where_the_tiered_start_applies(monkeypatch):
    monkeypatch.delenv("LABKIT_TIERED", raising=False)
    monkeypatch.setattr(P, "applies", lambda cfg, dev, world_size=1: True)
    gpu = torch.device("cuda")
    assert TI.applies(_tiny(), gpu) and not TI.applies(_tiny(), CPU)  # a CPU has no cores to spare
    monkeypatch.setattr(P, "applies", lambda cfg, dev, world_size=1: False)  # no saved forward for it: DDP, ...
    assert not TI.applies(_tiny(), gpu)
    monkeypatch.setattr(P, "applies", lambda cfg, dev, world_size=1: True)
    monkeypatch.setenv("LABKIT_TIERED", "0")
    assert not TI.applies(_tiny(), gpu)
    assert TI.start(_tiny(), gpu, GRAPH) is None


def test_the_childs_config_is_the_runs(monkeypatch):
    from labkit.faststart import warmstart

    built = []
    monkeypatch.setattr(os, "nice", lambda n: None)
    monkeypatch.setattr(CA, "load", lambda dev, folder, graphs, say: built.append(("artifact", folder, graphs)))
    monkeypatch.setattr(warmstart, "precompile", lambda cfg, dev, ds, folder: built.append((cfg, dev, ds.num_classes, folder)))
    cfg = T.preset("muon")
    spec = json.loads(json.dumps({"config": asdict(cfg), "device": "cpu", "graph": T.graph_key(cfg),
                                  "folder": "/out", "artifact_folder": "/art"}))
    assert TI.CHILD[-2:] == ["-m", "labkit.faststart.warmstart"]
    assert warmstart.build_forward(spec) == 1  # precompile returned nothing: exit 1, the run stays eager
    assert built == [("artifact", "/art", [T.graph_key(cfg)]), (cfg, CPU, 10, "/out")]


def test_graph_trees_are_set_up_in_a_thread_that_did_not_import_them(monkeypatch):
    from torch._inductor import cudagraph_trees as ct

    for init in (getattr(ct, "_initialize_tls", None), None):  # newer torch's own, and torch 2.11's lack of it
        if init is None:
            monkeypatch.delattr(ct, "_initialize_tls", raising=False)
        seen = {}

        def thread(seen=seen):
            seen["before"] = hasattr(ct.local, "tree_manager_containers")
            TI.graph_trees_here()
            seen["locks"] = ct.get_obj(ct.local, "tree_manager_locks")
            seen["stashed"] = torch._C._is_key_in_tls("tree_manager_containers")

        t = threading.Thread(target=thread)
        t.start()
        t.join()
        assert seen["before"] is False and seen["stashed"] and seen["locks"] is not None


def test_labkit_train_starts_tiered_and_closes_it_even_when_training_fails(tmp_path, monkeypatch):
    from labkit.cli import main

    class Fake:
        closed = 0

        def close(self):
            Fake.closed += 1
            return {"source": "saved forward"}

    started, trained = [], []
    monkeypatch.setattr(TI, "applies", lambda cfg, dev, world_size=1: True)
    monkeypatch.setattr(TI, "start", lambda cfg, dev, graph, world_size=1: started.append(graph) or Fake())
    monkeypatch.setattr(P, "load", lambda *a, **k: pytest.fail("loaded before the first step"))
    monkeypatch.setattr(CA, "load_for_cli", lambda *a: pytest.fail("artifact loaded"))
    monkeypatch.setattr(T, "train", lambda cfg, dev, **kw: trained.append(kw) or
                        {"img_per_s": 1.0, "final_loss": 2.0, "accuracy": None})
    out = tmp_path / "rec.json"
    assert main(["train", "--preset", "compile", "--device", "cpu", "--json", str(out)]) == 0
    assert isinstance(trained[-1]["tier"], Fake) and trained[-1]["precompiled"] is None and Fake.closed == 1
    assert json.loads(out.read_text())["tiered"] == {"source": "saved forward"}

    def fails(cfg, dev, **kw):
        raise LabkitError("the loss became NaN")

    monkeypatch.setattr(T, "train", fails)
    assert main(["train", "--preset", "compile", "--device", "cpu"]) == 2
    assert Fake.closed == 2  # the child is stopped however the run ends

    monkeypatch.setattr(T, "train", lambda cfg, dev, **kw: trained.append(kw) or
                        {"img_per_s": 1.0, "final_loss": 2.0, "accuracy": None})
    monkeypatch.setattr(CA, "load_for_cli", lambda args, *a: None)
    assert main(["train", "--preset", "compile", "--device", "cpu", "--no-compile-cache"]) == 0
    assert len(started) == 2 and trained[-1]["tier"] is None  # compile from scratch, before the first step


def test_the_cudnn_warmup_is_on_where_labkit_train_starts_tiered_unless_set(monkeypatch):
    from labkit.cli import main

    monkeypatch.setattr(TI, "start", lambda *a, **k: None)
    monkeypatch.setattr(CA, "load_for_cli", lambda *a: None)
    warmed = []
    monkeypatch.setattr(CW, "start", lambda cfg, dev, world_size=1: warmed.append(cfg.cudnn_warmup))
    monkeypatch.setattr(T, "train", lambda cfg, dev, **kw: {"img_per_s": 1.0, "final_loss": 2.0, "accuracy": None})
    for tiered, sets, want in ((True, [], True), (True, ["cudnn_warmup=false"], False), (False, [], False),
                               (False, ["cudnn_warmup=true"], True)):
        monkeypatch.setattr(TI, "applies", lambda cfg, dev, world_size=1, on=tiered: on)
        assert main(["train", "--preset", "compile", "--device", "cpu", *[a for s in sets for a in ("--set", s)]]) == 0
        assert warmed[-1] is want, (tiered, sets)
    assert main(["train", "--preset", "compile", "--device", "cpu", "--no-compile-cache"]) == 0
    assert warmed[-1] is False  # compiled before the first step: as the ladder runs it


def test_a_saved_forward_torch_cannot_load_costs_one_line_and_the_run_stays_eager(tmp_path, lines, anywhere,
                                                                                   inductor):
    got, say = lines
    header = {"card": CA.card(CPU), "torch": torch.__version__, "graph": GRAPH, "code": P.code_version(), "bytes": 4,
              "sha256": __import__("hashlib").sha256(b"junk").hexdigest()}
    path = CA._write(P.path_for(CPU, GRAPH, tmp_path), P.MAGIC, header, b"junk", print)
    tier = TI.start(_tiny(), CPU, GRAPH, tmp_path, say=say)
    tier._thread.join()
    assert tier.forward() is None and tier.close()["source"] is None
    assert len(got) == 1 and got[0].startswith(f"precompiled forward {path} could not be loaded (")
    assert got[0].endswith("): the run stays eager")


def test_a_switch_refused_partway_through_an_accumulated_step_trains_as_the_eager_run_does(lines):
    got, say = lines
    cfg = _tiny(accumulation=2)
    calls = []

    def refuses_the_second(model, x):  # the first micro-batch computes, the second is refused
        calls.append(x.shape[0])
        if len(calls) == 2:
            raise RuntimeError("GuardManager check failed, reason: a size")
        return model(x)

    eager = TI.Tier(cfg, CPU, say)
    eager._ready.set()
    want = T.train(cfg, "cpu", tier=eager)
    refused = TI.Tier(cfg, CPU, say)
    refused._fn = refuses_the_second
    got_rec = T.train(cfg, "cpu", tier=refused, on_step=lambda n: n == 1 and refused._ready.set())
    assert len(calls) == 2 and got_rec["losses"] == want["losses"]  # the first micro-batch's gradients not twice
    assert refused.close()["eager_steps"] == 6 and len(got) == 1
