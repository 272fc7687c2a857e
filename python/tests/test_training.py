"""A short CPU training loop with a torchvision model consumes the loader for two epochs."""

from __future__ import annotations

import torch
import torchvision

import birdtrain


def test_a_torchvision_model_trains_for_two_epochs(dataset, cache_dir):
    torch.manual_seed(0)
    loader = birdtrain.Loader(
        dataset, image_size=32, batch_size=8, workers=2, seed=3, last_batch="drop",
        cache_dir=cache_dir,
    )
    model = torchvision.models.resnet18(num_classes=len(loader.classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
    losses, seen = [], 0
    for epoch in range(2):
        loader.set_epoch(epoch)
        for images, labels in loader:
            x = (images.permute(0, 3, 1, 2).float() - mean) / std
            loss = torch.nn.functional.cross_entropy(model(x), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            seen += images.shape[0]
    assert seen == 2 * 32  # 33 images, the last batch of 1 dropped
    assert all(torch.isfinite(torch.tensor(losses)))
