"""Data sets that need no download, each with a fixed held-out split.

* ``digits``, ``wine``, ``breast_cancer``: the small data sets scikit-learn ships inside its wheel
  (``pip install "lopt[meta]"``); without scikit-learn they raise :class:`MissingDependency`.
* ``mnist1d``: lopt's own generator of a 1-d, 10-class data set in the spirit of MNIST-1D: ten
  fixed 1-d templates, each example one template stretched, scaled, shifted and sheared on a
  40-sample canvas, plus smooth and white noise. Generated offline from a seed, nothing downloaded.
* ``stdlib_text``: the source of a module that ships with Python (bytes; ``argparse`` by default)
  for a character-level language model.

Features are standardised with the training split's mean and standard deviation (per feature for
the tables, over all pixels for digits); every split is a
fixed permutation (seed 0), so a data set is the same on every machine with the same versions.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch


class MissingDependency(ImportError):
    """An optional dependency (scikit-learn) is not installed; the message says what to install."""


@dataclass
class Dataset:
    name: str
    train_x: torch.Tensor  # float32 (N, *input_shape) for features; int64 (N,) tokens for text
    train_y: torch.Tensor | None
    test_x: torch.Tensor
    test_y: torch.Tensor | None
    num_classes: int
    input_shape: tuple

    def to(self, device) -> "Dataset":
        def move(t):
            return None if t is None else t.to(device)

        return Dataset(self.name, move(self.train_x), move(self.train_y), move(self.test_x), move(self.test_y),
                       self.num_classes, self.input_shape)


def _split(x: torch.Tensor, y: torch.Tensor, test_fraction: float, name: str, num_classes: int, input_shape,
           per_feature: bool = True) -> Dataset:
    """A fixed split; features standardised by the training split's statistics, per feature (tables) or
    over all pixels at once (images, ``per_feature=False``: digits has pixels that are 0 in every
    training image and not in every test image)."""
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    flat = x.reshape(len(x), -1)
    if per_feature:
        mean, std = flat[train].mean(0), flat[train].std(0).clamp_min(1e-6)
    else:
        mean, std = flat[train].mean(), flat[train].std()
    x = ((flat - mean) / std).reshape(x.shape).to(torch.float32)
    return Dataset(name, x[train], y[train], x[test], y[test], num_classes, tuple(input_shape))


SKLEARN_LOADERS = ("load_digits", "load_wine", "load_breast_cancer")
EXPORT_ENV = "LOPT_META_DATA"


def _sklearn(loader: str):
    """(x float32, y int64) of one of scikit-learn's bundled data sets, or the same arrays from the file
    ``$LOPT_META_DATA`` (written by ``python -m lopt.meta.data export FILE`` where scikit-learn is
    installed: for a machine without it, e.g. an offline GPU machine)."""
    exported = os.environ.get(EXPORT_ENV)
    if exported:
        arrays = torch.load(exported, weights_only=True)
        if loader in arrays:
            return arrays[loader]["x"], arrays[loader]["y"]
    try:
        datasets = importlib.import_module("sklearn.datasets")
    except ImportError:
        raise MissingDependency("this task needs scikit-learn's bundled data sets: pip install \"lopt[meta]\" "
                                f"(or pip install scikit-learn), or point {EXPORT_ENV} at a file written by "
                                f"`python -m lopt.meta.data export FILE` on a machine that has it") from None
    bunch = getattr(datasets, loader)()
    x = torch.tensor(bunch.data, dtype=torch.float32)
    y = torch.tensor(bunch.target, dtype=torch.int64)
    return x, y


def export(path) -> Path:
    """Write scikit-learn's three bundled data sets' arrays to ``path`` (for ``$LOPT_META_DATA``)."""
    saved = os.environ.pop(EXPORT_ENV, None)
    try:
        arrays = {}
        for loader in SKLEARN_LOADERS:
            x, y = _sklearn(loader)
            arrays[loader] = {"x": x, "y": y}
    finally:
        if saved is not None:
            os.environ[EXPORT_ENV] = saved
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(arrays, path)
    return path


def digits() -> Dataset:
    """scikit-learn's 8×8 handwritten digits: 1797 images, 10 classes; 20% held out. Inputs (1, 8, 8)."""
    x, y = _sklearn("load_digits")
    return _split(x.reshape(-1, 1, 8, 8), y, 0.2, "digits", 10, (1, 8, 8), per_feature=False)


def wine() -> Dataset:
    """scikit-learn's wine: 178 samples, 13 features, 3 classes; 30% held out."""
    x, y = _sklearn("load_wine")
    return _split(x, y, 0.3, "wine", 3, (13,))


def breast_cancer() -> Dataset:
    """scikit-learn's breast cancer (Wisconsin): 569 samples, 30 features, 2 classes; 25% held out."""
    x, y = _sklearn("load_breast_cancer")
    return _split(x, y, 0.25, "breast_cancer", 2, (30,))


def _smooth(x: torch.Tensor, width: float) -> torch.Tensor:
    """Gaussian smoothing along the last axis (reflect-free: zero padded)."""
    radius = int(3 * width) + 1
    offsets = torch.arange(-radius, radius + 1, dtype=torch.float32)
    kernel = torch.exp(-0.5 * (offsets / width) ** 2)
    kernel = (kernel / kernel.sum()).view(1, 1, -1)
    return torch.nn.functional.conv1d(x.unsqueeze(1), kernel, padding=radius).squeeze(1)


def mnist1d_templates(num_classes: int = 10, points: int = 12) -> torch.Tensor:
    """The ten fixed 1-d templates (num_classes, points), each with peak |value| 1 (seed 1234, never changes)."""
    generator = torch.Generator().manual_seed(1234)
    raw = torch.randn(num_classes, points, generator=generator).cumsum(-1)
    raw = raw - raw.mean(-1, keepdim=True)
    raw = _smooth(raw, 0.8)
    return raw / raw.abs().amax(-1, keepdim=True)


def make_mnist1d(n: int, seed: int, length: int = 40, num_classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` examples (n, length) and labels (n,): template stretched ×[0.6, 1.2] to ~20 samples,
    scaled ×[0.6, 1.4], placed at a random offset, a random linear trend (±0.4 at the ends), smooth
    noise (white noise ×0.4 smoothed with a Gaussian of width 2) and white noise (σ 0.15)."""
    generator = torch.Generator().manual_seed(seed)
    templates = mnist1d_templates(num_classes)
    labels = torch.randint(num_classes, (n,), generator=generator)
    stretch = torch.empty(n).uniform_(0.6, 1.2, generator=generator)
    amplitude = torch.empty(n).uniform_(0.6, 1.4, generator=generator)
    offset_u = torch.rand(n, generator=generator)
    slope = torch.empty(n).uniform_(-0.4, 0.4, generator=generator)
    smooth_noise = _smooth(torch.randn(n, length, generator=generator), 2.0) * 0.4
    white_noise = torch.randn(n, length, generator=generator) * 0.15
    sizes = (20 * stretch).round().clamp_min(4).to(torch.int64)
    starts = (offset_u * (length - sizes + 1).to(torch.float32)).to(torch.int64)
    canvas = torch.zeros(n, length)
    for size in sizes.unique().tolist():
        patterns = torch.nn.functional.interpolate(templates.unsqueeze(1), size=size, mode="linear",
                                                   align_corners=True).squeeze(1)  # (classes, size)
        rows = (sizes == size).nonzero().view(-1)
        columns = starts[rows].unsqueeze(1) + torch.arange(size)
        canvas[rows.unsqueeze(1), columns] = patterns[labels[rows]] * amplitude[rows].unsqueeze(1)
    trend = slope.unsqueeze(1) * torch.linspace(-1.0, 1.0, length)
    return canvas + trend + smooth_noise + white_noise, labels


def mnist1d(n_train: int = 4000, n_test: int = 1000, seed: int = 0) -> Dataset:
    """lopt's offline MNIST-1D-style data set: 40 samples per example, 10 classes (train and test drawn
    from the same generator with different seeds)."""
    train_x, train_y = make_mnist1d(n_train, seed=seed * 2 + 1)
    test_x, test_y = make_mnist1d(n_test, seed=seed * 2 + 2)
    mean, std = train_x.mean(0), train_x.std(0).clamp_min(1e-6)
    return Dataset("mnist1d", (train_x - mean) / std, train_y, (test_x - mean) / std, test_y, 10, (40,))


def stdlib_text(module: str = "argparse", test_fraction: float = 0.1) -> Dataset:
    """The source file of a standard-library module as byte tokens over the bytes it uses; the last
    ``test_fraction`` held out. ``name`` records the module, the Python version and the text's sha256."""
    import sys

    path = Path(importlib.import_module(module).__file__)
    data = path.read_bytes()
    vocab = sorted(set(data))
    lookup = torch.full((256,), -1, dtype=torch.int64)
    lookup[torch.tensor(vocab)] = torch.arange(len(vocab))
    tokens = lookup[torch.tensor(list(data), dtype=torch.int64)]
    cut = int(len(tokens) * (1 - test_fraction))
    digest = hashlib.sha256(data).hexdigest()[:12]
    name = f"{module}.py (Python {sys.version_info.major}.{sys.version_info.minor}, sha256 {digest}...)"
    return Dataset(name, tokens[:cut], None, tokens[cut:], None, len(vocab), ())


DATASETS = {"digits": digits, "wine": wine, "breast_cancer": breast_cancer, "mnist1d": mnist1d}
_CACHE: dict = {}


def load(name: str) -> Dataset:
    """A data set by name (cached per process, on the CPU)."""
    if name not in _CACHE:
        if name not in DATASETS:
            raise ValueError(f"unknown data set {name!r}; known: {sorted(DATASETS)}")
        _CACHE[name] = DATASETS[name]()
    return _CACHE[name]


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "export":
        sys.exit("usage: python -m lopt.meta.data export FILE   (scikit-learn's bundled data sets, for $LOPT_META_DATA)")
    print(export(sys.argv[2]))
