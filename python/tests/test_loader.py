"""birdtrain.Loader: batches, validation path, draws, sharding, bad files, arguments."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from PIL import Image
from torchvision import transforms

import birdtrain
from conftest import CLASSES, write_dataset
from helpers import digest, image_hashes


def test_batches_are_uint8_nhwc_images_and_int64_labels(dataset, cache_dir):
    loader = birdtrain.Loader(
        dataset, image_size=32, batch_size=8, workers=2, cache_dir=cache_dir
    )
    assert loader.classes == CLASSES
    assert len(loader) == 5  # 33 images, partial last batch
    sizes = []
    for images, labels in loader:
        assert images.dtype == torch.uint8 and labels.dtype == torch.int64
        assert images.shape[1:] == (32, 32, 3)
        assert labels.shape == (images.shape[0],)
        assert 0 <= int(labels.min()) and int(labels.max()) < len(CLASSES)
        sizes.append(images.shape[0])
    assert sizes == [8, 8, 8, 8, 1]
    assert loader.bad_files == []


def test_validation_path_matches_torchvision_resize_and_center_crop(dataset, cache_dir):
    loader = birdtrain.Loader(
        dataset,
        split="valid",
        resize_mode="center-crop",
        store_size=256,
        image_size=224,
        crop_pct=0.875,
        batch_size=5,
        workers=2,
        cache_dir=cache_dir,
    )
    reference = transforms.Compose(
        [transforms.Resize(256), transforms.CenterCrop(224), transforms.PILToTensor()]
    )
    files = sorted((dataset / "valid").glob("*/*.jpg"))
    assert len(files) == 12
    got = torch.cat([images for images, _ in loader])
    assert got.shape == (12, 224, 224, 3)
    for path, image in zip(files, got):
        with Image.open(path) as pil:
            expected = reference(pil.convert("RGB")).permute(1, 2, 0)
        diff = (image.int() - expected.int()).abs().float()
        # Two JPEG decoders (libjpeg-turbo's and the engine's) and two bilinear filters,
        # one crop that torchvision rounds to whole pixels: see docs/python.md.
        assert diff.mean() <= MEAN_TOLERANCE, f"{path}: mean difference {diff.mean():.2f}"
        assert torch.quantile(diff.flatten(), 0.99) <= P99_TOLERANCE, f"{path}: 99th percentile"
        assert diff.max() <= MAX_TOLERANCE, f"{path}: largest difference {diff.max()}"


# The validation path's documented tolerance against torchvision on PIL, in levels of 255
# (docs/python.md; measured 0.12, 1 and 3 on these JPEGs).
MEAN_TOLERANCE = 0.5
P99_TOLERANCE = 2.0
MAX_TOLERANCE = 6.0


def run_epochs(dataset, cache_dir, epochs, **settings):
    loader = birdtrain.Loader(
        dataset, image_size=48, batch_size=7, cache_dir=cache_dir, **settings
    )
    return [[digest(x, y) for x, y in loader] for _ in range(epochs)]


def test_training_draws_are_fixed_by_seed_and_epoch_whatever_the_workers(dataset, tmp_path):
    settings = dict(color_jitter=0.4, auto_augment="ta_wide", seed=5)
    one = run_epochs(dataset, tmp_path / "a", 2, workers=1, **settings)
    three = run_epochs(dataset, tmp_path / "b", 2, workers=3, **settings)
    assert one == three
    assert one[0] != one[1], "each epoch draws afresh"
    other_seed = run_epochs(dataset, tmp_path / "c", 1, workers=2, color_jitter=0.4, seed=6)
    assert other_seed[0] != one[0]


def test_flip_mirrors_about_half_the_images_of_a_train_epoch(dataset, cache_dir):
    plain = birdtrain.Loader(
        dataset, image_size=32, batch_size=33, augment="none", flip=False,
        shuffle=False, cache_dir=cache_dir,
    )
    flipped = birdtrain.Loader(
        dataset, image_size=32, batch_size=33, augment="none", shuffle=False,
        cache_dir=cache_dir,
    )
    (a, _), = list(plain)
    (b, _), = list(flipped)
    mirrored = [torch.equal(b[i], a[i].flip(1)) for i in range(33)]
    same = [torch.equal(b[i], a[i]) for i in range(33)]
    assert all(m or s for m, s in zip(mirrored, same))
    assert 5 <= sum(mirrored) <= 28


def test_world_size_two_epochs_are_disjoint_and_cover_the_split(dataset, cache_dir):
    common = dict(image_size=16, batch_size=4, augment="none", flip=False, cache_dir=cache_dir)
    whole = birdtrain.Loader(dataset, batch_size=33, rank=0, world_size=1, **{
        k: v for k, v in common.items() if k != "batch_size"})
    all_images = sorted(h for x, _ in whole for h in image_hashes(x))
    assert len(set(all_images)) == 33
    for last_batch, expected in (("partial", 33), ("drop", 32), ("pad", 40)):
        ranks = [
            birdtrain.Loader(dataset, rank=r, world_size=2, last_batch=last_batch, **common)
            for r in (0, 1)
        ]
        assert len(ranks[0]) == len(ranks[1])
        seen = [[h for x, _ in loader for h in image_hashes(x)] for loader in ranks]
        assert len(seen[0]) + len(seen[1]) == expected, last_batch
        if last_batch != "pad":
            assert not set(seen[0]) & set(seen[1])
            assert len(set(seen[0]) | set(seen[1])) == expected
        else:
            assert set(seen[0]) | set(seen[1]) == set(all_images)


def test_rank_and_world_size_come_from_the_environment(dataset, cache_dir, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    loader = birdtrain.Loader(dataset, image_size=16, batch_size=4, cache_dir=cache_dir)
    assert (loader.rank, loader.world_size) == (1, 3)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    loader = birdtrain.Loader(dataset, image_size=16, batch_size=4, cache_dir=cache_dir)
    assert (loader.rank, loader.world_size) == (0, 1)


def test_kept_tensors_keep_their_pixels_and_released_buffers_are_reused(dataset, cache_dir):
    loader = birdtrain.Loader(
        dataset, image_size=32, batch_size=4, prefetch=1, workers=2, cache_dir=cache_dir
    )
    kept = [(x, x.clone()) for x, _ in loader]
    # Every batch kept alive: the pool grew instead of overwriting a viewed buffer.
    assert all(torch.equal(view, copy) for view, copy in kept)
    del kept
    free = loader._engine.free_buffers()
    assert free >= 9
    for batch in loader:
        pass
    del batch
    assert loader._engine.free_buffers() == free, "released buffers are reused, none allocated"


def test_set_epoch_and_iterating_again_move_through_epochs(dataset, cache_dir):
    loader = birdtrain.Loader(dataset, image_size=16, batch_size=8, cache_dir=cache_dir)
    first = [digest(x, y) for x, y in loader]
    second = [digest(x, y) for x, y in loader]
    assert loader.epoch == 2
    loader.set_epoch(1)
    assert [digest(x, y) for x, y in loader] == second
    loader.set_epoch(0)
    assert [digest(x, y) for x, y in loader] == first


def bad_dataset(root: Path) -> Path:
    write_dataset(root, {"train": 4}, [(64, 48)])
    good = (root / "train" / "crow" / "crow_000.jpg").read_bytes()
    (root / "train" / "crow" / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (root / "train" / "finch" / "notes.jpg").write_text("not an image at all\n")
    (root / "train" / "wren" / "empty.jpg").write_bytes(b"")
    return root


def test_bad_files_are_skipped_and_listed(tmp_path, cache_dir):
    root = bad_dataset(tmp_path / "data")
    with pytest.warns(UserWarning) as warned:
        loader = birdtrain.Loader(root, image_size=16, batch_size=5, cache_dir=cache_dir)
        total = sum(x.shape[0] for x, _ in loader)
    assert total == 12
    named = sorted(Path(str(w.message).split(": ")[1]).name for w in warned)
    assert named == ["empty.jpg", "notes.jpg", "truncated.jpg"], "one warning per bad file"
    assert loader.stats()["bad_files"] == 3
    listed = {Path(p).name: kind for p, kind in loader.bad_files}
    assert set(listed) == {"truncated.jpg", "notes.jpg", "empty.jpg"}
    assert listed["empty.jpg"] == "empty"
    assert listed["notes.jpg"] == "not-an-image"
    assert listed["truncated.jpg"] in ("truncated", "corrupt")


def test_a_bad_file_fails_with_one_exception_naming_it(tmp_path, cache_dir):
    root = tmp_path / "data"
    write_dataset(root, {"train": 3}, [(64, 48)])
    good = (root / "train" / "wren" / "wren_000.jpg").read_bytes()
    (root / "train" / "wren" / "cut.jpg").write_bytes(good[: len(good) // 2])
    with pytest.raises(birdtrain.BadImageError, match="cut.jpg") as raised:
        loader = birdtrain.Loader(
            root, image_size=16, batch_size=4, on_bad_image="fail", cache_dir=cache_dir
        )
        for _ in loader:
            pass
    assert Path(raised.value.path).name == "cut.jpg"


@pytest.mark.parametrize(
    "argument, value",
    [
        ("split", "training"),
        ("image_size", 0),
        ("batch_size", -1),
        ("batch_size", 2.5),
        ("seed", -3),
        ("shuffle", "yes"),
        ("augment", "random"),
        ("crop_scale", 1.5),
        ("flip", 1),
        ("color_jitter", -0.1),
        ("auto_augment", "everything"),
        ("store_size", 8),
        ("resize_mode", "stretch"),
        ("crop_pct", 0.875),  # with the training split's resized crop
        ("last_batch", "keep"),
        ("rank", 2),
        ("world_size", 0),
        ("workers", 0),
        ("prefetch", 0),
        ("on_bad_image", "ignore"),
        ("pin_memory", "no"),
        ("valid_fraction", 1.0),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(dataset, cache_dir, argument, value):
    settings = dict(image_size=16, batch_size=4, cache_dir=cache_dir)
    settings[argument] = value
    if argument == "rank":
        settings["world_size"] = 2
    with pytest.raises(ValueError, match=argument):
        birdtrain.Loader(dataset, **settings)


def test_a_flat_folder_is_split_by_valid_fraction(tmp_path, cache_dir):
    root = tmp_path / "flat"
    write_dataset(root, {"train": 10}, [(48, 40)])
    flat = root / "train"
    train = birdtrain.Loader(flat, image_size=16, batch_size=64, valid_fraction=0.2,
                             cache_dir=cache_dir)
    valid = birdtrain.Loader(flat, split="valid", image_size=16, batch_size=64,
                             valid_fraction=0.2, cache_dir=cache_dir)
    assert train.classes == CLASSES
    counts = [sum(x.shape[0] for x, _ in loader) for loader in (train, valid)]
    assert counts == [24, 6]


def test_a_missing_folder_is_a_clear_error(tmp_path, cache_dir):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        birdtrain.Loader(tmp_path / "nowhere", cache_dir=cache_dir)


def test_a_batch_never_turned_into_a_tensor_still_returns_its_buffer(dataset, cache_dir):
    # One batch an epoch: no later batch takes the buffer back before it is counted.
    loader = birdtrain.Loader(dataset, image_size=16, batch_size=33, cache_dir=cache_dir)
    batches = loader._engine.epoch(0, 0)
    images, labels, step = next(batches)
    assert step == 0
    free = loader._engine.free_buffers()
    del images, labels  # capsules dropped unconsumed
    assert loader._engine.free_buffers() == free + 1
