import numpy as np
import pytest
import torch

from labkit import data as D
from labkit.env import LabkitError


@pytest.fixture(scope="module")
def small():
    return D.synthetic_cifar(4000, 1000, seed=0, cache=False)


def test_synthetic_is_deterministic_and_shaped(small):
    again = D.synthetic_cifar(4000, 1000, seed=0, cache=False)
    assert np.array_equal(small.x_train, again.x_train) and np.array_equal(small.y_test, again.y_test)
    other = D.synthetic_cifar(4000, 1000, seed=1, cache=False)
    assert not np.array_equal(small.x_train, other.x_train)
    assert small.x_train.shape == (4000, 32, 32, 3) and small.x_train.dtype == np.uint8
    assert small.y_train.dtype == np.int64 and small.num_classes == 10
    counts = np.bincount(small.y_train, minlength=10)
    assert counts.min() > 300  # balanced classes
    assert small.x_train.std() > 20  # not a blank image set


def test_synthetic_cache_roundtrip_and_corrupt_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_DATA", str(tmp_path))
    a = D.synthetic_cifar(64, 16, seed=3)
    files = list(tmp_path.glob("synthetic-cifar-64-16-s3-*.npz"))
    assert len(files) == 1
    b = D.synthetic_cifar(64, 16, seed=3)
    assert np.array_equal(a.x_train, b.x_train)
    files[0].write_bytes(b"garbage")
    c = D.synthetic_cifar(64, 16, seed=3)
    assert np.array_equal(a.x_train, c.x_train)


def test_linear_classifier_on_raw_pixels_stays_under_half(small):
    # Ridge regression onto one-hot labels: a strong linear baseline with a closed form.
    x = small.x_train.reshape(len(small.x_train), -1).astype(np.float64) / 255
    mu, sd = x.mean(0), x.std(0) + 1e-6
    x = (x - mu) / sd
    y = np.eye(10)[small.y_train]
    w = np.linalg.solve(x.T @ x + 100.0 * np.eye(x.shape[1]), x.T @ y)
    xt = (small.x_test.reshape(len(small.x_test), -1) / 255 - mu) / sd
    acc = (np.argmax(xt @ w, 1) == small.y_test).mean()
    train_acc = (np.argmax(x @ w, 1) == small.y_train).mean()
    assert train_acc > acc  # it did fit something
    assert acc < 0.5


def test_image_folder_roundtrip_is_lossless(tmp_path, small):
    sub = small.subset(50, 10)
    folder = D.write_image_folder(sub, tmp_path, "train")
    ds = D.ImageFileDataset(folder, augment=False)
    assert len(ds) == 50
    x0, y0 = ds[0]
    ref = D.normalize(D.to_nchw_uint8(sub.x_train[:1]))[0]
    assert y0 == sub.y_train[0]
    assert torch.allclose(x0, ref, atol=1e-5)
    # Written once: a second call finds it complete and does not rewrite.
    mtime = next(folder.glob("*/*.png")).stat().st_mtime_ns
    D.write_image_folder(sub, tmp_path, "train")
    assert next(folder.glob("*/*.png")).stat().st_mtime_ns == mtime


def test_corrupt_image_and_missing_folder_errors(tmp_path, small):
    folder = D.write_image_folder(small.subset(20, 5), tmp_path, "train")
    victim = sorted(folder.glob("*/*.png"))[0]
    victim.write_bytes(b"\x89PNG not really")
    ds = D.ImageFileDataset(folder, augment=False)
    idx = ds.files.index(victim)
    with pytest.raises(LabkitError, match="corrupt or unreadable image"):
        ds[idx]
    with pytest.raises(LabkitError, match="does not exist"):
        D.image_folder_files(tmp_path / "nope")
    (tmp_path / "empty" / "0").mkdir(parents=True)
    with pytest.raises(LabkitError, match="no image files"):
        D.image_folder_files(tmp_path / "empty")


def test_augment_batch_crops_and_flips_correctly():
    torch.manual_seed(0)
    x = torch.randint(0, 256, (16, 3, 8, 8), dtype=torch.uint8)
    out = D.augment_batch(x, torch.Generator().manual_seed(0), pad=2)
    assert out.shape == x.shape and out.dtype == torch.uint8
    xp = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(16):
        windows = [xp[i, :, a:a + 8, b:b + 8] for a in range(5) for b in range(5)]
        assert any(torch.equal(out[i], w) or torch.equal(out[i], w.flip(-1)) for w in windows)
    again = D.augment_batch(x, torch.Generator().manual_seed(0), pad=2)
    assert torch.equal(out, again)
    assert not torch.equal(out, D.augment_batch(x, torch.Generator().manual_seed(1), pad=2))


def test_digits_real_data_ships_with_package():
    d = D.digits32()
    assert d.x_train.shape[1:] == (32, 32, 3) and len(d.y_train) + len(d.y_test) == 1797
    assert set(np.unique(d.y_train)) == set(range(10))


def test_cifar10_offline_gives_clear_error(monkeypatch, tmp_path):
    import urllib.error

    import torchvision.datasets

    def offline(*a, **k):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", offline)
    with pytest.raises(LabkitError, match="offline"):
        D.cifar10(tmp_path)


def test_unknown_dataset():
    with pytest.raises(LabkitError, match="unknown dataset"):
        D.load("imagenet")


def test_epoch_order_is_a_permutation_and_seeded():
    a, b = D.epoch_order(100, 0, 0), D.epoch_order(100, 0, 1)
    assert sorted(a.tolist()) == list(range(100)) and not torch.equal(a, b)
    assert torch.equal(a, D.epoch_order(100, 0, 0))
