"""A silo's own images, one sub-folder per class (``data-source = "image-folder"``;
docs/own-data.md).

``data-path`` is a directory laid out in one of two ways:

- ``<class>/<image>``: the silo draws its train / validation / test split with its
  ``data-seed``;
- ``train/<class>/<image>``, ``test/<class>/<image>`` and optionally ``val/<class>/<image>``:
  the split is given (a top-level folder named train, val or test means this layout).

A class folder is named by the schema's class name (``class-names``), or by its integer label
0..C-1 when the schema names no classes. A silo may lack a class (no folder), but a class folder
that is there holds images. Images are PNG or JPEG files (``.png``, ``.jpg``, ``.jpeg``, any
case), decoded with Pillow, turned upright by their EXIF orientation, converted to the schema's
channels (1: grayscale ``L``, 3: ``RGB``, alpha dropped), resized to the schema's height x width
with Pillow's bilinear filter when their size differs (deterministic; it averages over the
covered pixels when shrinking), scaled from 0..255 to [0, 1] and then normalised per channel
with the schema's ``image-mean`` / ``image-std`` if it sets them.

Hidden entries (names starting with ``.``, such as ``.DS_Store``) are ignored; any other file
that is not an image is refused rather than skipped, so that a silo's record count never
silently depends on what it failed to read. Records are ordered by split, then class label,
then file name, so the same folder always gives the same records.

Images whose float32 records fit in the silo's ``records-memory`` are decoded into tensors when
the silo starts. Larger folders are read when used (:class:`ImageRows`): the silo lists the
files and decodes every image once at start-up, so an image that does not decode is refused
before anything is trained, and afterwards decodes the images a step asks for, keeping the
most recently used ones' pixels in a cache of at most ``records-memory`` bytes. Both ways
build a record with the same code, so they give the same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from .assembly import class_labels, client_data, lazy_parts, records_memory, split_rows
from .partition import ClientData
from .readers import DataError
from .records import ByteCache, Inputs, fits_in_memory
from .schema import Schema
from .sources import SPLITS, SourceRequest

#: The file name endings read as images (compared in lower case).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
#: How an image whose size differs from the schema's is resized.
RESAMPLING = Image.Resampling.BILINEAR
#: Pillow's mode for a schema's number of channels.
_MODES = {1: "L", 3: "RGB"}


@dataclass(frozen=True)
class _Image:
    """One record: its file, its label and its given split (an index of SPLITS; -1: drawn)."""

    path: Path
    label: int
    split: int


def load_image_folder(request: SourceRequest) -> ClientData:
    """The ``image-folder`` data source: the images under the silo's ``data-path`` (module
    docstring) as float32 records (n, C, H, W) built to the schema, with their split: in
    memory, or read when used if they do not fit in the silo's ``records-memory``."""
    root, schema = request.path, request.schema
    shape = _image_shape(schema, root)
    images = _listed(root, schema)
    given = np.array([i.split for i in images]) if images[0].split >= 0 else None
    split = split_rows(len(images), given, request, root)
    labels = np.array([image.label for image in images], dtype=np.int64)
    budget = records_memory(request)
    parts: dict[str, tuple[Inputs, torch.Tensor]]
    if fits_in_memory(len(images), shape, budget):
        parts = {name: (_records([images[row].path for row in rows], shape, schema),
                        torch.from_numpy(labels[rows])) for name, rows in split.items()}
    else:
        reader = ImageRows([image.path for image in images], shape, schema, ByteCache(budget))
        reader.check_all()
        parts = lazy_parts(reader, labels, split, shape)
    return client_data(request.client_id, parts, root)


class ImageRows:
    """Records of an image folder decoded when they are read (a
    :data:`~.records.RowReader`): row ``i`` is the image at ``paths[i]``, built exactly as
    the in-memory records are (:func:`_records`). Decoded pixels (uint8, a quarter of the
    float32 record) are kept in ``cache``, most recently used first."""

    def __init__(self, paths: list[Path], shape: tuple[int, int, int], schema: Schema,
                 cache: ByteCache) -> None:
        self.paths, self.shape, self.schema, self.cache = paths, shape, schema, cache

    def check_all(self) -> None:
        """Decode every image once, in order, so one that does not decode is refused before
        any training (the pixels are kept only as far as the cache holds them)."""
        for row in range(len(self.paths)):
            self._pixels(row)

    def _pixels(self, row: int) -> np.ndarray:
        pixels = self.cache.get(row)
        if pixels is None:
            pixels = _decoded(self.paths[row], self.shape)
            self.cache.put(row, pixels)
        return pixels

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        pixels = [self._pixels(int(row)) for row in rows]
        return _normalised(_stacked(pixels, self.shape), self.schema).numpy()


def _records(paths: list[Path], shape: tuple[int, int, int], schema: Schema
             ) -> torch.Tensor:
    """The images at ``paths`` as float32 records (n, C, H, W), built to the schema."""
    return _normalised(_stacked([_decoded(path, shape) for path in paths], shape), schema)


def _stacked(pixels: list[np.ndarray], shape: tuple[int, int, int]) -> np.ndarray:
    return np.stack(pixels) if pixels else np.zeros((0, *shape), dtype=np.uint8)


def _image_shape(schema: Schema, root: Path) -> tuple[int, int, int]:
    """(C, H, W) of the schema; refused unless it is an image of 1 or 3 channels."""
    shape = schema.input_shape
    if len(shape) != 3 or shape[0] not in _MODES:
        raise DataError(f"{root}: the image-folder source builds images of 1 or 3 channels "
                        f"(input-shape channels,height,width); the federation's schema says "
                        f"input-shape {','.join(map(str, shape))}")
    return shape[0], shape[1], shape[2]


def _listed(root: Path, schema: Schema) -> list[_Image]:
    """Every image under ``root``, in the records' order, with its label and given split."""
    if not root.is_dir():
        problem = "not a directory" if root.exists() else "no such file or directory"
        raise DataError(f"{root}: {problem}; the image-folder source reads a directory with "
                        "one sub-folder per class")
    entries = _visible(root)
    if any(entry.name in SPLITS for entry in entries):
        images = _given_split(root, entries, schema)
    else:
        images = _class_folders(root, schema, split=-1)
    if not images:
        raise DataError(f"{root}: no images (expected one sub-folder per class holding "
                        f"{', '.join(IMAGE_SUFFIXES)} files)")
    return images


def _given_split(root: Path, entries: list[Path], schema: Schema) -> list[_Image]:
    for entry in entries:
        if entry.name not in SPLITS or not entry.is_dir():
            raise DataError(f"{entry}: beside the split folders train/, val/ and test/ the "
                            "image folder holds nothing else")
    for needed in ("train", "test"):
        if not (root / needed).is_dir():
            raise DataError(f"{root}: a given split needs the folders train/ and test/ "
                            f"(val/ is optional); {needed}/ is missing")
    return [image for index, split in enumerate(SPLITS) if (root / split).is_dir()
            for image in _class_folders(root / split, schema, index)]


def _class_folders(folder: Path, schema: Schema, split: int) -> list[_Image]:
    """The images of ``folder``'s class sub-folders, by label, then file name."""
    classes = []
    for entry in _visible(folder):
        if not entry.is_dir():
            raise DataError(f"{entry}: a file where class folders are expected (one "
                            "sub-folder per class)")
        label = int(class_labels([entry.name], schema, entry, "the folder name is")[0])
        classes.append((label, entry))
    images = []
    for label, entry in sorted(classes):
        files = _visible(entry)
        if not files:
            raise DataError(f"{entry}: empty class folder (a class the silo lacks has no "
                            "folder)")
        for file in files:
            if not file.is_file() or file.suffix.lower() not in IMAGE_SUFFIXES:
                raise DataError(f"{file}: not an image file; a class folder holds only "
                                f"{', '.join(IMAGE_SUFFIXES)} files (hidden files are ignored)")
            images.append(_Image(file, label, split))
    return images


def _visible(folder: Path) -> list[Path]:
    """``folder``'s entries by name, hidden ones (``.name``) left out."""
    try:
        return sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    except OSError as exc:
        raise DataError(f"{folder}: cannot be listed ({exc.strerror})") from None


#: EXIF orientations that turn an image by 90 degrees, so its stored width is its height.
_QUARTER_TURNS = {5, 6, 7, 8}


def adjusted_images(root: Path, schema: Schema) -> tuple[int, int]:
    """How many of the folder's images the reader converts to the schema's channels, and how
    many it resizes to the schema's height x width, from each file's header alone (no pixel
    is decoded): ``dpcfl data check`` says so, since a converted or resized image is not the
    image the silo stored."""
    channels, height, width = _image_shape(schema, root)
    converted = resized = 0
    for image in _listed(root, schema):
        try:
            with Image.open(image.path) as opened:
                converted += opened.mode != _MODES[channels]
                size = opened.size
                if opened.getexif().get(0x0112) in _QUARTER_TURNS:  # Orientation
                    size = size[::-1]
                resized += size != (width, height)
        except Exception:  # noqa: BLE001 - the reader refuses it, naming the file
            continue
    return converted, resized


def _decoded(path: Path, shape: tuple[int, int, int]) -> np.ndarray:
    """The pixels (uint8, C x H x W) of the image at ``path``, in the schema's channels and
    size."""
    channels, height, width = shape
    try:
        with Image.open(path) as opened:
            image = ImageOps.exif_transpose(opened).convert(_MODES[channels])
    except Exception as exc:  # a damaged file fails in many ways in Pillow
        # (OSError, SyntaxError, struct.error, DecompressionBombError, ...): all are this file
        raise DataError(f"{path}: does not decode as an image ({type(exc).__name__})"
                        ) from None
    if image.size != (width, height):
        image = image.resize((width, height), RESAMPLING)
    pixels = np.asarray(image, dtype=np.uint8)
    return pixels.reshape(height, width, channels).transpose(2, 0, 1)


def _normalised(pixels: np.ndarray, schema: Schema) -> torch.Tensor:
    """uint8 pixels (n, C, H, W) scaled to [0, 1], then ``(x - mean) / std`` per channel if
    the schema sets image-mean / image-std (the same float32 operations as the benchmarks'
    reader, so an exported benchmark gives the very same numbers)."""
    x = torch.from_numpy(pixels.astype(np.float32)) / 255.0
    if schema.image_mean:
        mean = torch.tensor(schema.image_mean, dtype=torch.float32).view(1, -1, 1, 1)
        std = torch.tensor(schema.image_std, dtype=torch.float32).view(1, -1, 1, 1)
        x = (x - mean) / std
    return x.contiguous()
