"""Storage formats, decoders and loader variants: same images, same samples per epoch, seeded augmentation."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from labkit import bench
from labkit import data as D
from labkit import loader_bench as LB
from labkit import loaders as L
from labkit.env import REPO_ROOT, LabkitError

N = 100  # not a multiple of the batch sizes below: partial last batches are exercised


@pytest.fixture(scope="module")
def data():
    return D.synthetic_cifar(N, 16, seed=0, cache=False)


@pytest.fixture(scope="module")
def store_for(data, tmp_path_factory):
    return LB.stores(data, tmp_path_factory.mktemp("stores"))


def _epoch(cfg, store_for, epoch=0, device="cpu"):
    loader = L.ImageLoader(cfg, store_for(cfg), device)
    loader.set_epoch(epoch)
    try:
        xs, ys = zip(*[(x, y) for x, y in loader], strict=True)
    finally:
        loader.close()
    return torch.cat(xs), torch.cat(ys)


def _reference(store_for, batch_size=32, epoch=0):
    """The naive path built by hand: labkit.data.ImageFileDataset in a DataLoader over EpochSampler."""
    folder = store_for(L.LoaderConfig(storage="folder", image_format="png")).path
    sampler = D.EpochSampler(N, 0)
    sampler.set_epoch(epoch)
    dl = torch.utils.data.DataLoader(D.ImageFileDataset(folder, augment=False), batch_size=batch_size,
                                     sampler=sampler)
    xs, ys = zip(*list(dl), strict=True)
    return L.to_uint8(torch.cat(xs)), torch.cat(ys)


def test_every_store_decodes_to_the_same_pixels(data, store_for):
    want = torch.from_numpy(data.x_train).permute(0, 3, 1, 2)
    for storage in ("folder", "tar", "records"):
        for fmt in L.IMAGE_FORMATS:
            st = store_for(L.LoaderConfig(storage=storage, image_format=fmt))
            got = {dec: L.BatchReader(st, dec)[(0, 0, list(range(N)))][0] for dec in ("pil", "torchvision")}
            for dec, x in got.items():
                assert x.shape == want.shape and x.dtype == torch.uint8, (storage, fmt, dec)
                err = (x.int() - want.int()).abs().float()
                if fmt == "png":  # lossless
                    assert err.max() == 0, (storage, dec)
                else:  # JPEG quality 95 of noisy textures: close (pixel noise is ~15 levels), never exact
                    assert 0 < err.mean() < 15, (storage, dec, err.mean())
            assert (got["pil"].int() - got["torchvision"].int()).abs().max() <= 2, (storage, fmt)
    packed = store_for(L.LoaderConfig(storage="packed"))
    assert torch.equal(L.BatchReader(packed)[(0, 0, list(range(N)))][0], want)


def test_encoded_bytes_are_identical_across_stores(store_for):
    folder = L.BatchReader(store_for(L.LoaderConfig(storage="folder", image_format="jpg")))
    for storage in ("tar", "records"):
        r = L.BatchReader(store_for(L.LoaderConfig(storage=storage, image_format="jpg")))
        assert all(r.encoded(i) == folder.encoded(i) for i in (0, 7, N - 1)), storage
        assert np.array_equal(r.labels, folder.labels)


def test_bytes_on_disk(data, store_for):
    packed = store_for(L.LoaderConfig(storage="packed")).disk_bytes()
    raw = data.x_train.nbytes + data.y_train.nbytes
    assert packed["files"] == 2 and raw < packed["apparent"] < raw + 1024  # two .npy headers on top
    folder = store_for(L.LoaderConfig(storage="folder", image_format="png")).disk_bytes()
    records = store_for(L.LoaderConfig(storage="records", image_format="png")).disk_bytes()
    tar = store_for(L.LoaderConfig(storage="tar", image_format="png")).disk_bytes()
    assert folder["files"] == N and records["files"] == 3 and tar["files"] == 1
    # The same PNG bytes either way; the tar shard adds two 512-byte headers and padding per image.
    assert abs(records["apparent"] - folder["apparent"]) < 0.05 * folder["apparent"]
    assert tar["apparent"] > folder["apparent"] + N * 512


@pytest.mark.parametrize("cfg", [
    L.preset("naive", augment="none", batch_size=32, workers=0),
    L.LoaderConfig(storage="packed", augment="none", batch_size=32),
    L.LoaderConfig(storage="packed", augment="none", batch_size=7, workers=2, prefetch_factor=3),
    L.LoaderConfig(storage="folder", decoder="torchvision", augment="none", batch_size=64),
    L.LoaderConfig(storage="tar", decoder="pil", augment="none", batch_size=32),
    L.LoaderConfig(storage="tar", decoder="torchvision", augment="none", batch_size=32, workers=2,
                   persistent_workers=True),
    L.LoaderConfig(storage="records", decoder="pil", augment="none", batch_size=13),
    L.LoaderConfig(storage="records", decoder="torchvision", augment="none", batch_size=32, workers=1),
], ids=lambda c: f"{c.storage}-{c.decoder}-b{c.batch_size}-w{c.workers}")
def test_every_variant_yields_the_reference_samples(cfg, store_for):
    ref_x, ref_y = _reference(store_for, epoch=1)
    x, y = _epoch(cfg, store_for, epoch=1)
    assert x.dtype == torch.float32 and x.shape == (N, 3, 32, 32) and y.dtype == torch.int64
    x8 = L.to_uint8(x)
    # The same multiset of (image, label) pairs ...
    key = lambda xx, yy: sorted(bytes(a.numpy().tobytes()) + bytes([int(b)]) for a, b in zip(xx, yy, strict=True))  # noqa: E731
    assert key(x8, y) == key(ref_x, ref_y)
    # ... and, since every path follows labkit.data.epoch_order, in the same order.
    assert torch.equal(y, ref_y) and torch.equal(x8, ref_x)


def test_each_epoch_has_a_new_order_and_the_same_samples(store_for):
    cfg = L.LoaderConfig(storage="packed", augment="none", batch_size=32)
    loader = L.ImageLoader(cfg, store_for(cfg))
    e0, e1 = (torch.cat([y for _, y in loader]) for _ in range(2))
    assert not torch.equal(e0, e1) and torch.equal(e0.sort().values, e1.sort().values)
    assert len(loader) == -(-N // 32)
    dropped = L.ImageLoader(L.with_changes(cfg, drop_last=True), store_for(cfg))
    assert [len(y) for _, y in dropped] == [32, 32, 32] and len(dropped) == 3


def _is_crop_or_flip(out_u8: torch.Tensor, src_u8: torch.Tensor, pad: int = 4) -> bool:
    """Is `out` one of the 2 x 9 x 9 zero-padded crops (with or without a horizontal flip) of `src`?"""
    p = torch.nn.functional.pad(src_u8, (pad, pad, pad, pad))
    crops = p.unfold(1, 32, 1).unfold(2, 32, 1).permute(1, 2, 0, 3, 4).reshape(-1, 3, 32, 32)
    cands = torch.cat([crops, crops.flip(-1)])
    return bool((cands == out_u8).flatten(1).all(1).any())


@pytest.mark.parametrize("cfg", [
    L.preset("naive", batch_size=32, workers=0),
    L.LoaderConfig(storage="packed", augment="per-sample", batch_size=32),
    L.LoaderConfig(storage="packed", augment="batched", batch_size=32),
    L.LoaderConfig(storage="records", augment="batched", batch_size=32, decoder="torchvision"),
    L.LoaderConfig(storage="packed", augment="on-device", batch_size=32),
], ids=lambda c: f"{c.storage}-{c.augment}")
def test_augmentation_keeps_samples_shapes_and_dtypes(cfg, data, store_for):
    _, ref_y = _reference(store_for)
    x, y = _epoch(cfg, store_for)
    assert x.dtype == torch.float32 and x.shape == (N, 3, 32, 32)
    assert torch.equal(y, ref_y)  # the same samples, in the same order; only the pixels moved
    order = D.epoch_order(N, 0, 0)
    src = torch.from_numpy(data.x_train).permute(0, 3, 1, 2)[order]
    x8 = L.to_uint8(x)
    assert all(_is_crop_or_flip(x8[i], src[i]) for i in range(N))
    assert (x8 != src).flatten(1).any(1).float().mean() > 0.5  # and most images really were moved


@pytest.mark.parametrize("augment", ["per-sample", "batched", "on-device"])
def test_augmentation_is_seeded_and_independent_of_workers(augment, store_for):
    cfg = L.LoaderConfig(storage="packed", augment=augment, batch_size=16)
    a, _ = _epoch(cfg, store_for)
    torch.manual_seed(123)  # the global RNG must not matter ...
    b, _ = _epoch(cfg, store_for)
    assert torch.equal(a, b)
    if augment != "on-device":  # ... nor the number of worker processes
        c, _ = _epoch(L.with_changes(cfg, workers=2), store_for)
        assert torch.equal(a, c)
    other, _ = _epoch(L.with_changes(cfg, seed=1), store_for)
    assert not torch.equal(_by_sample(a, 0, 0), _by_sample(other, 1, 0))
    nxt, _ = _epoch(cfg, store_for, epoch=1)
    assert not torch.equal(_by_sample(a, 0, 0), _by_sample(nxt, 0, 1))


def _by_sample(x, seed, epoch):
    """Rows of an epoch's output put back in sample-index order."""
    return x[D.epoch_order(N, seed, epoch).argsort()]


def test_per_sample_augmentation_leaves_the_callers_rng_alone(store_for):
    cfg = L.LoaderConfig(storage="packed", augment="per-sample", batch_size=16)
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    _epoch(cfg, store_for)
    assert torch.equal(torch.rand(3), want)


def test_bad_configs_fail_clearly(data, store_for, tmp_path):
    cpu = torch.device("cpu")
    for changes, match in [
        (dict(storage="lmdb"), "storage must be"),
        (dict(decoder="turbo"), "decoder must be"),
        (dict(augment="mixup"), "augment must be"),
        (dict(batch_size=0), "batch_size"),
        (dict(workers=0, prefetch_factor=2), "prefetch_factor needs workers"),
        (dict(workers=0, persistent_workers=True), "persistent_workers needs workers"),
        (dict(storage="records", image_format="jpg", decoder="cuda"), "needs a CUDA GPU"),
    ]:
        with pytest.raises(LabkitError, match=match):
            L.check_config(L.with_changes(L.LoaderConfig(), **changes), cpu)
    with pytest.raises(LabkitError, match="unknown LoaderConfig"):
        L.with_changes(L.LoaderConfig(), num_workers=2)
    with pytest.raises(LabkitError, match="unknown loader preset"):
        L.preset("turbo")
    with pytest.raises(LabkitError, match="reads tar storage"):
        L.ImageLoader(L.LoaderConfig(storage="tar"), store_for(L.LoaderConfig(storage="packed")))
    with pytest.raises(LabkitError, match="image format"):
        L.write_store(data, "records", "webp", tmp_path)
    with pytest.raises(LabkitError, match="cannot sweep"):
        LB.sweep(L.LoaderConfig(), "seed", [0, 1], store_for)


def test_corrupt_stores_raise_labkit_errors(data, tmp_path):
    st = L.write_store(data, "records", "png", tmp_path)
    index = np.load(st.path / "index.npy")
    with open(st.path / "images.rec", "r+b") as f:
        f.seek(int(index[3, 0]))
        f.write(b"\x00" * 16)
    cfg = L.LoaderConfig(storage="records", augment="none", batch_size=8)
    with pytest.raises(LabkitError, match="image 3 .* cannot be decoded"):
        list(L.ImageLoader(cfg, st))
    tar = L.write_store(data, "tar", "png", tmp_path)
    (tar.path / "shard-000000.tar").write_bytes(b"not a tar file" * 100)
    with pytest.raises(LabkitError, match="unreadable|do not pair"):
        L.BatchReader(tar)
    (st.path / "labels.npy").write_bytes(b"junk")
    with pytest.raises(LabkitError, match="missing or corrupt"):
        L.BatchReader(st)


def test_sweep_rows_and_skips(store_for):
    rows = LB.sweep(L.LoaderConfig(storage="packed", batch_size=50), "pin_memory", [False, True], store_for,
                    repeats=1)
    assert rows[0]["samples_per_s"] > 0 and rows[0]["samples"] == N
    if not torch.cuda.is_available():
        assert "CUDA" in rows[1]["skipped"]
    rows = LB.sweep(L.LoaderConfig(storage="packed", batch_size=50), "workers", [0, 1], store_for, repeats=1)
    assert [r["workers"] for r in rows] == [0, 1] and all(r["samples_per_s"] > 0 for r in rows)
    md = LB.rows_table(rows, "workers")
    assert md.count("\n") == 3


def test_packed_loader_is_faster_than_the_image_folder_path(store_for):
    # Both measured here, interleaved; the benchmark reports the real ratio (~10x), this only guards against
    # a packed path that lost its advantage.
    naive = L.preset("naive", workers=0, batch_size=50)
    packed = L.preset("packed", batch_size=50)
    a, b = L.ImageLoader(naive, store_for(naive)), L.ImageLoader(packed, store_for(packed))
    with LB.torch_threads(1):
        r = bench.compare(lambda: LB._drain(a), lambda: LB._drain(b), rounds=3, warmup=1)
    assert r.ratio > 2, str(r)


def test_format_and_decoder_tables(data, tmp_path):
    small = data.subset(24)
    rows = LB.format_table(small, root=tmp_path, image_formats=("png",), decoders=("torchvision",), repeats=1)
    assert [r["storage"] for r in rows] == ["packed", "folder", "tar", "records"]
    assert all(r["samples_per_s"] > 0 and r["bytes"] > 24 * 500 for r in rows)
    assert "| packed | raw uint8 |" in LB.format_markdown(rows)
    dec = LB.decoder_table(small, n=8, repeats=1)
    assert {(r["image_format"], r["decoder"]) for r in dec if "skipped" not in r} >= {
        ("png", "pil"), ("png", "torchvision"), ("jpg", "pil"), ("jpg", "torchvision")}


def test_plot_workers_draws_model_lines():
    import matplotlib

    matplotlib.use("Agg")
    rows = [{"workers": w, "samples_per_s": 1000.0 * (w + 1)} for w in (0, 1, 2)]
    ax = LB.plot_workers({"naive": rows}, {"baseline model": {"img_per_s": 1500.0}})
    assert len(ax.lines) == 2 and "1,500" in ax.get_legend().get_texts()[1].get_text()


def test_loaders_sits_below_loader_bench():
    """labkit.loader_bench measures the pipelines of labkit.loaders and imports it, never the other way round."""
    assert LB.torch_threads is bench.torch_threads  # re-exported from labkit.bench, where bucketing finds it too
    assert not hasattr(L, "sweep") and not hasattr(L, "add_cli")  # `labkit data` is registered once, by loader_bench
    code = "import sys, labkit.loaders; assert 'labkit.loader_bench' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_cli_data_runs_on_cpu(tmp_path, capsys):
    from labkit import cli

    out = tmp_path / "out"
    code = cli.main(["data", "--sweep", "workers,augment", "--workers", "0", "--n", "64", "--device", "cpu",
                     "--no-model", "--out", str(out)])
    assert code == 0
    res = json.loads((out / "data.json").read_text())
    assert {r["loader"] for r in res["workers"]} == {"naive", "packed"}
    assert (out / "workers.png").stat().st_size > 0
    assert "no CUDA" in capsys.readouterr().out
    assert cli.main(["data", "--sweep", "bogus"]) == 2
    assert cli.main(["data", "--workers", "a,b"]) == 2


def test_benchmark_quick_runs_on_cpu(tmp_results):
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "week4_loaders.py"), "--quick", "--device",
                           "cpu", "--out", str(tmp_results)], capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "TQDM_DISABLE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = bench.load_result(tmp_results / "week4_loaders.json")
    assert res["env"]["device_type"] == "cpu" and res["quick"]
    assert {r["loader"] for r in res["workers"]} == {"naive", "packed"}
    assert len(res["baseline_rung"]) == 3 and res["model_rates"]["baseline model"]["img_per_s"] > 0
    assert [r["strategy"] for r in res["padding"]] == ["max", "dynamic", "bucket", "pack"]


def test_model_rates_never_asks_for_a_batch_larger_than_its_images(monkeypatch):
    """Quick mode on a GPU (LABKIT_QUICK=1 there: week 4's notebook, `labkit data --quick`) trained the tuned rung at
    its batch of 512 on quick mode's 256 images, and the cell stopped with "batch_size 512 is larger than the 256
    training images". Found running the notebooks quick on an H200. Each rung is now fitted as the ladder fits it:
    on a card without bf16 tensor cores (a T4) the tuned rung trains in fp16 instead of being refused."""
    import torch

    from labkit import train as T

    bf16 = {"yes": True}
    monkeypatch.setattr(T, "native_bf16", lambda device: bf16["yes"])  # the GPU's side, without a GPU
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for device, quick, n in [(cuda, True, None), (cuda, False, None), (cuda, True, 100), (cpu, True, 64)]:
        cfgs = LB.rate_configs(device, quick, n)
        assert set(cfgs) == ({"baseline model", "tuned model"} if device.type == "cuda" else {"baseline model"})
        for cfg in cfgs.values():
            assert cfg.batch_size <= cfg.n_train and cfg.loader == "resident" and cfg.epochs == 2
    assert LB.rate_configs(cuda, False)["tuned model"].batch_size == 512  # full size keeps the rung's batch
    bf16["yes"] = False
    assert LB.rate_configs(cuda, True)["tuned model"].precision == "fp16"
