"""The compiled forward saved whole (labkit.faststart.precompiled): built once, loaded instead of traced; anything wrong
means torch.compile with the artifact, said once."""

import copy
import hashlib

import pytest
import torch
from torch import nn

from labkit import train as T
from labkit.bench import compile_cache
from labkit.env import LabkitError
from labkit.faststart import compile_artifacts as CA
from labkit.faststart import precompiled as P

CPU = torch.device("cpu")
needs_aot = pytest.mark.skipif(not P.supported(), reason="this torch cannot save compiled functions")


class Tiny(nn.Module):
    """A convolution, BatchNorm (training statistics), ReLU and a classifier: a few kernels to compile on a CPU."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _write(path, header, payload=b"saved function"):
    header = {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest(), **header}
    return CA._write(path, P.MAGIC, header, payload, say=print)


@needs_aot
def test_a_saved_forward_loads_and_computes_what_the_model_does_with_its_backward(tmp_path, lines, inductor):
    got, say = lines
    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(8, 3, 8, 8)
    ref = copy.deepcopy(model)
    cfg = T.TrainConfig(compile="default")
    with compile_cache(tmp_path / "cache"):
        path = P.build(cfg, model, x, {"graph": 1}, tmp_path, say=say)
        assert path == P.path_for(CPU, {"graph": 1}, tmp_path) and not got
        fn = P.load(cfg, CPU, {"graph": 1}, tmp_path, say=say)
        assert fn is not None and got == [f"precompiled forward: loaded {path.name} (the first step traces nothing)"]
        out = fn(model, x)
    want = ref(x)
    out.square().mean().backward()
    want.square().mean().backward()
    torch.testing.assert_close(out, want)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean)  # BatchNorm's statistics updated too
    assert inductor.compile_threads == 1  # nothing compiles: no compile workers started for it
    with pytest.raises(RuntimeError, match="[Gg]uard"):  # its guards still check every call
        fn(model, torch.randn(4, 3, 8, 8))


def test_a_forward_that_cannot_be_saved_whole_is_said_once(tmp_path, lines, monkeypatch):
    got, say = lines
    monkeypatch.setattr(P, "supported", lambda: True)
    monkeypatch.setattr(torch, "compile", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("graph break\nmore")))
    assert P.build(T.TrainConfig(compile="default"), Tiny(), torch.randn(2, 3, 8, 8), {}, tmp_path, say=say) is None
    assert got == ["precompiled forward: not built (RuntimeError: graph break)"] and not list(tmp_path.iterdir())


def test_where_a_saved_forward_applies(monkeypatch):
    monkeypatch.delenv("LABKIT_PRECOMPILED", raising=False)
    compiled = T.TrainConfig(compile="default")
    assert P.forward_for(T.with_changes(compiled, precision="bf16"), torch.device("cuda")) is P.forward_cuda_bf16
    assert P.forward_for(T.with_changes(compiled, precision="fp16"), CPU) is None  # no fp16 autocast on a CPU
    assert not P.applies(T.TrainConfig(), CPU)  # nothing compiled
    assert not P.applies(compiled, CPU, world_size=2)  # DDP wraps the model
    assert not P.applies(T.with_changes(compiled, checkpointing=True), CPU)
    assert not P.applies(T.with_changes(compiled, precision="fp16"), CPU)
    assert not P.applies(T.with_changes(compiled, compile_tuning=True), CPU)  # its kernels would tune again
    assert P.applies(compiled, CPU) == P.loadable()
    monkeypatch.setenv("LABKIT_PRECOMPILED", "0")
    assert not P.applies(compiled, CPU)


def test_each_graph_has_its_own_file_beside_the_artifact(tmp_path):
    a, b = P.path_for(CPU, {"batch_size": 512}, tmp_path), P.path_for(CPU, {"batch_size": 4096}, tmp_path)
    assert a != b and a.parent == b.parent == tmp_path == CA.artifact_path(CPU, tmp_path).parent
    assert a.name.startswith(CA.artifact_stem(CPU) + ".") and a.name.endswith(P.SUFFIX)


@needs_aot
def test_a_missing_file_is_silent_and_a_bad_one_is_said_once(tmp_path, lines, inductor, monkeypatch):
    got, say = lines
    cfg, graph = T.TrainConfig(compile="default"), {"graph": 1}
    path = P.path_for(CPU, graph, tmp_path)
    assert P.load(cfg, CPU, graph, tmp_path, say=say) is None and not got  # no file: the artifact path, silently

    path.write_bytes(b"junk")
    assert P.load(cfg, CPU, graph, tmp_path, say=say) is None
    assert got.pop() == (f"precompiled forward {path} is unusable (ValueError: not a labkit compile cache): "
                         f"compiling with the artifact instead")
    mine = {"card": CA.card(CPU), "torch": torch.__version__, "graph": graph, "code": P.code_version()}
    for other, what in (({"torch": "1.0"}, "torch"), ({"graph": {"graph": 2}}, "graph"), ({"code": "0"}, "model code")):
        _write(path, {**mine, **other})
        assert P.load(cfg, CPU, graph, tmp_path, say=say) is None
        assert got.pop() == (f"precompiled forward {path} is stale (built for another {what}): compiling with the "
                             f"artifact instead")
    _write(path, mine)  # a header that fits, bytes torch cannot load
    inductor.compile_threads = 7
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    assert P.load(cfg, CPU, graph, tmp_path, say=say) is None
    assert got.pop().startswith(f"precompiled forward {path} could not be loaded (")
    assert inductor.compile_threads == 7 and not got  # the artifact path keeps its compile workers


def test_training_runs_a_loaded_forward_outside_autocast_in_place_of_torch_compile(monkeypatch):
    calls = []

    def loaded(model, x):  # what load() returns: f(model, x), its own autocast inside
        calls.append(torch.is_autocast_enabled("cpu"))
        return model(x)

    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("torch.compile ran"))
    cfg = T.with_changes(T.quick_base(), width=4, n_train=64, n_test=32, batch_size=16, max_steps=2, epochs=1,
                         compile="default", precision="bf16", evaluate=False)
    rec = T.train(cfg, "cpu", precompiled=loaded)
    assert calls == [False, False] and rec["precompiled"] and rec["steps"] == 2

    def unfit(model, x):
        raise RuntimeError("GuardManager check failed, reason: a size")

    with pytest.raises(LabkitError, match="the saved forward .* does not fit this run .*LABKIT_PRECOMPILED=0"):
        T.train(cfg, "cpu", precompiled=unfit)


def test_labkit_train_loads_the_saved_forward_instead_of_the_artifact(tmp_path, monkeypatch, capsys):
    from labkit.cli import main

    monkeypatch.setenv("LABKIT_COMPILE_CACHE", str(tmp_path))
    sentinel, asked, artifact, trained = object(), [], [], []
    monkeypatch.setattr(P, "load", lambda cfg, dev, graph, **kw: asked.append(graph) or sentinel)
    monkeypatch.setattr(CA, "load_for_cli", lambda *a: artifact.append(a))
    monkeypatch.setattr(T, "train", lambda cfg, dev, **kw: trained.append(kw["precompiled"]) or
                        {"img_per_s": 1.0, "final_loss": 2.0, "accuracy": None})
    assert main(["train", "--preset", "compile", "--device", "cpu"]) == 0
    cfg = T.fit_rung(T.preset("compile"), CPU, False)
    assert asked == [T.graph_key(cfg)] and trained == [sentinel] and not artifact
    assert main(["train", "--preset", "compile", "--device", "cpu", "--no-compile-cache"]) == 0
    assert len(asked) == 1 and trained[-1] is None  # nothing loaded at all
