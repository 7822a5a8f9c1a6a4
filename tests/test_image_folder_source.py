"""The image-folder source (``data-source = "image-folder"``): real PNG / JPEG files written
with Pillow give the records the schema says, pixel for pixel; a bad folder is one line naming
the path; a benchmark silo's records exported as an image folder train the same round."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dpcfl_flwr.data import DataError
from dpcfl_flwr.data.image_folder import load_image_folder
from dpcfl_flwr.data.schema import Schema
from dpcfl_flwr.data.sources import SourceRequest, draw_split
from tests.test_malicious_server import Attacker, _node_config, _run_config, _update, silo_data
from tests.test_own_records import SCHEMA, _arrays_node

GRAY = Schema((1, 28, 28), 3)


def _request(path: Path, schema: Schema = GRAY, seed: int = 4) -> SourceRequest:
    return SourceRequest(path, 2, seed, 0.25, 0.2, schema)


def _write(folder: Path, name: str, pixels: np.ndarray) -> Path:
    """``pixels`` (H, W) or (H, W, 3) uint8 as an image file ``folder/name``."""
    folder.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(folder / name)
    return folder / name


def _folder(root: Path, per_class: dict[str, int], shape: tuple[int, ...] = (28, 28),
            seed: int = 0) -> list[tuple[np.ndarray, int]]:
    """Random images written as PNG under ``root/<class>/``; (pixels, class position) in the
    order the source reads them (by class, then file name)."""
    rng = np.random.default_rng(seed)
    written = []
    for position, (name, count) in enumerate(per_class.items()):
        for index in range(count):
            pixels = rng.integers(0, 256, shape, dtype=np.uint8)
            _write(root / name, f"img-{index:03d}.png", pixels)
            written.append((pixels, position))
    return written


def test_png_pixels_are_exact_and_the_split_is_draw_split(tmp_path):
    written = _folder(tmp_path, {"0": 7, "1": 6, "2": 7})
    data = load_image_folder(_request(tmp_path))
    pixels = np.stack([p for p, _ in written])[:, None].astype(np.float32) / np.float32(255)
    labels = np.array([label for _, label in written])
    rows = draw_split(20, 4, 0.25, 0.2)
    for split in ("train", "val", "test"):
        np.testing.assert_array_equal(getattr(data, f"x_{split}").numpy(), pixels[rows[split]])
        np.testing.assert_array_equal(getattr(data, f"y_{split}").numpy(), labels[rows[split]])
    assert (data.client_id, data.cluster, data.x_train.dtype) == (2, -1, torch.float32)
    again = load_image_folder(_request(tmp_path))
    assert torch.equal(again.x_train, data.x_train)


def test_rgb_is_normalised_per_channel_as_the_schema_says(tmp_path):
    schema = Schema((3, 8, 8), 2, ("cat", "dog"), image_mean=(0.5, 0.4, 0.3),
                    image_std=(0.2, 0.25, 0.5))
    rng = np.random.default_rng(1)
    images = {name: rng.integers(0, 256, (3, 8, 8, 3), dtype=np.uint8) for name in ("cat", "dog")}
    for name, stack in images.items():
        for index, pixels in enumerate(stack):
            _write(tmp_path / "train" / name, f"{index}.png", pixels)
        _write(tmp_path / "test" / name, "t.png", stack[0])
    data = load_image_folder(_request(tmp_path, schema))
    mean, std = np.array([0.5, 0.4, 0.3]), np.array([0.2, 0.25, 0.5])
    expected = (np.concatenate([images["cat"], images["dog"]]) / 255.0 - mean) / std
    np.testing.assert_allclose(data.x_train.numpy(), expected.transpose(0, 3, 1, 2),
                               rtol=0, atol=1e-5)
    assert data.y_train.tolist() == [0, 0, 0, 1, 1, 1] and data.y_test.tolist() == [0, 1]
    assert len(data.y_val) == 0  # no val/ folder: no validation records


def test_a_given_split_a_missing_class_and_hidden_files(tmp_path):
    rng = np.random.default_rng(2)
    for split, count in (("train", 3), ("val", 1), ("test", 2)):
        for index in range(count):
            _write(tmp_path / split / "2", f"{index}.png", rng.integers(0, 256, (28, 28),
                                                                          dtype=np.uint8))
    (tmp_path / "train" / "2" / ".DS_Store").write_bytes(b"\0")
    (tmp_path / ".hidden").mkdir()
    data = load_image_folder(_request(tmp_path))  # classes 0 and 1 absent: fine
    assert (len(data.y_train), len(data.y_val), len(data.y_test)) == (3, 1, 2)
    assert set(data.y_train.tolist()) == {2}


def test_other_sizes_are_resized_bilinearly_and_jpeg_is_read(tmp_path):
    rng = np.random.default_rng(3)
    big = rng.integers(0, 256, (40, 36, 3), dtype=np.uint8)  # RGB, to grayscale 28x28
    _write(tmp_path / "0", "a.png", big)
    _write(tmp_path / "0", "b.png", big)
    _write(tmp_path / "1", "c.jpeg", big)
    _write(tmp_path / "1", "d.JPG", big)
    data = load_image_folder(SourceRequest(tmp_path, 0, 0, 0.25, 0.25, GRAY))
    resized = Image.fromarray(big).convert("L").resize((28, 28), Image.Resampling.BILINEAR)
    expected = np.asarray(resized, dtype=np.float32) / np.float32(255)
    x = torch.cat([data.x_train, data.x_val, data.x_test])
    y = torch.cat([data.y_train, data.y_val, data.y_test])
    assert any(np.array_equal(r[0].numpy(), expected) for r in x[y == 0])
    assert x.shape[1:] == (1, 28, 28) and float(x.min()) >= 0 and float(x.max()) <= 1
    # JPEG is lossy, but close to the same picture
    assert float((x[y == 1] - torch.from_numpy(expected)).abs().mean()) < 0.05


def _undecodable(root: Path) -> str:
    _folder(root, {"0": 2})
    (root / "0" / "img-001.png").write_bytes(b"not a png at all")
    return "img-001.png: does not decode as an image"


# Each case makes the folder and returns the words its error line must hold.
def _truncated(root: Path) -> str:
    _folder(root, {"0": 3}, shape=(64, 64))
    damaged = root / "0" / "img-002.png"
    damaged.write_bytes(damaged.read_bytes()[:900])
    return "img-002.png: does not decode as an image"


@pytest.mark.parametrize("make", [
    lambda root: "records: no such file or directory",
    _truncated,
    lambda root: (root.write_text("x"), "records: not a directory")[-1],
    lambda root: (root.mkdir(), "records: no images")[-1],
    _undecodable,
    lambda root: (_folder(root, {"0": 2}), (root / "1").mkdir(),
                  "records/1: empty class folder")[-1],
    lambda root: (_folder(root, {"0": 2, "7": 2}),
                  "records/7: the folder name is not one of the schema's classes (0..2)")[-1],
    lambda root: (_folder(root, {"0": 2}), (root / "0" / "notes.txt").write_text("x"),
                  "records/0/notes.txt: not an image file")[-1],
    lambda root: (_folder(root / "train", {"0": 3}),
                  "records: a given split needs the folders train/ and test/ (val/ is "
                  "optional); test/ is missing")[-1],
    lambda root: (_folder(root / "train", {"0": 3}), _folder(root / "test", {"0": 1}),
                  _folder(root / "extra", {"0": 1}), "records/extra: beside the split")[-1],
    lambda root: (_folder(root, {"0": 2}), (root / "x.png").write_bytes(b""),
                  "records/x.png: a file where class folders are expected")[-1],
    lambda root: (_folder(root, {"0": 1}), "records: 1 training records; a silo needs")[-1],
])
def test_a_bad_folder_is_one_line_naming_the_path(tmp_path, make):
    root = tmp_path / "records"
    expected = make(root)
    with pytest.raises(DataError) as caught:
        load_image_folder(_request(root))
    message = str(caught.value)
    assert expected in message and "\n" not in message and str(root) in message


def test_class_names_name_the_folders(tmp_path):
    schema = Schema((1, 28, 28), 2, ("benign", "malignant"))
    _folder(tmp_path, {"malignant": 3, "benign": 2})
    data = load_image_folder(SourceRequest(tmp_path, 0, 0, 0.25, 0.2, schema))
    labels = torch.cat([data.y_train, data.y_val, data.y_test]).tolist()
    assert sorted(labels) == [0, 0, 1, 1, 1]
    _folder(tmp_path, {"0": 2})  # an integer label is not a class when classes are named
    with pytest.raises(DataError, match=r"/0: the folder name is not one of the schema's "
                                        r"classes \(class-names benign, malignant\)"):
        load_image_folder(SourceRequest(tmp_path, 0, 0, 0.25, 0.2, schema))


def test_a_schema_that_is_not_an_image_is_refused(tmp_path):
    _folder(tmp_path, {"0": 3})
    with pytest.raises(DataError, match="images of 1 or 3 channels .* input-shape 5"):
        load_image_folder(_request(tmp_path, Schema((5,), 3)))


def _export_images(data, root: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A benchmark silo's normalised Fashion-MNIST records back to 8-bit PNGs in split and
    class folders (file names keep each split's order); per split, the records' order in
    the folder (by class, then file name) and their pixels."""
    order, pixels = {}, {}
    for split in ("train", "val", "test"):
        x, y = getattr(data, f"x_{split}").numpy(), getattr(data, f"y_{split}").numpy()
        unscaled = (x * 0.3081 + 0.1307) * 255  # the benchmark's fmnist normalisation
        pixels[split] = np.rint(unscaled).astype(np.uint8)
        assert np.abs(unscaled - pixels[split]).max() < 1e-3  # they were 8-bit pixels
        for index, (image, label) in enumerate(zip(pixels[split], y, strict=True)):
            _write(root / split / str(label), f"{index:05d}.png", image[0])
        order[split] = np.argsort(y, kind="stable")
    return order, pixels


def test_a_benchmark_silo_as_an_image_folder_trains_the_same_round(tmp_path,
                                                                    server_task_identity):
    """Fashion-MNIST records exported as PNGs give the image-folder silo the very same
    records (in the folder's order), the same N_i and ledger, and, with the same noise seed,
    the same update as those records given as arrays: the folder path changes nothing."""
    seeded = {"noise-seed": 7}
    benchmark = Attacker(tmp_path / "benchmark", _node_config(tmp_path / "benchmark", **seeded))
    data = silo_data(benchmark)
    order, _ = _export_images(data, tmp_path / "folder")
    run = _run_config(tmp_path, **{"image-mean": "0.1307", "image-std": "0.3081"})
    pinned = f'{SCHEMA}image-mean = "0.1307"\nimage-std = "0.3081"\n'
    node = _arrays_node(tmp_path / "own", tmp_path / "folder", pinned,
                        **{"data-source": "image-folder", **seeded})
    folder = Attacker(tmp_path / "own", node, run)
    mine = silo_data(folder)
    for split, rows in order.items():
        assert torch.equal(getattr(mine, f"x_{split}"), getattr(data, f"x_{split}")[rows])
        assert torch.equal(getattr(mine, f"y_{split}"), getattr(data, f"y_{split}")[rows])
    np.savez(tmp_path / "same.npz", **{f"{a}_{s}": getattr(mine, f"{a}_{s}").numpy()
                                       for a in "xy" for s in ("train", "val", "test")})
    arrays = Attacker(tmp_path / "arrays", _arrays_node(tmp_path / "arrays",
                                                        tmp_path / "same.npz", pinned,
                                                        **seeded), run)
    replies = [a.train(1, cluster=-2) for a in (benchmark, folder, arrays)]
    assert not any(r.has_error() for r in replies)
    np.testing.assert_array_equal(_update(replies[1]), _update(replies[2]))
    assert benchmark.ledger().entries == folder.ledger().entries  # same N_i, so the same z


def test_a_bad_folder_is_refused_before_any_charge(tmp_path, server_task_identity, caplog):
    _undecodable(tmp_path / "folder")
    node = _arrays_node(tmp_path, tmp_path / "folder", **{"data-source": "image-folder"})
    attacker = Attacker(tmp_path, node, _run_config(tmp_path))
    reply = attacker.train(1, cluster=-2)
    assert reply.has_error() and "img-001.png" not in reply.error.reason
    assert "img-001.png: does not decode as an image" in caplog.text  # the operator's log
    assert not attacker.ledger_path.exists() or not attacker.ledger().entries


def test_the_check_counts_images_converted_or_resized(tmp_path):
    """Three grayscale 28 x 28 images, two RGB ones, one 20 x 20 one and one stored 28 x 20
    but turned upright by its EXIF orientation (20 x 28 once turned): the reader converts 2
    and resizes 2, as the header-only count says."""
    from dpcfl_flwr.data.image_folder import adjusted_images

    _folder(tmp_path, {"0": 3})
    rgb = np.zeros((28, 28, 3), dtype=np.uint8)
    for index in range(2):
        Image.fromarray(rgb).save(tmp_path / "0" / f"rgb-{index}.png")
    _write(tmp_path / "0", "small.png", np.zeros((20, 20), dtype=np.uint8))
    turned = Image.fromarray(np.zeros((20, 28), dtype=np.uint8))  # width 28, height 20
    exif = turned.getexif()
    exif[0x0112] = 6  # rotate 90 degrees on display: 20 wide, 28 high
    turned.save(tmp_path / "0" / "turned.jpg", exif=exif)
    assert adjusted_images(tmp_path, Schema((1, 28, 28), 10)) == (2, 2)
    assert adjusted_images(tmp_path, Schema((1, 28, 20), 10)) == (2, 6)  # only "turned" fits
