"""Task families whose instances train side by side: every parameter has a leading axis ``n``.

A *family* fixes the architecture and the data (so every instance has the same parameter shapes
and the instances of a population step together as batched tensors); an *instance* is one draw of
its randomness: the initial parameters, the data order, a synthetic task's teacher or class means,
and the weight-rescale factor. Parameters are kept in ``torch.nn`` layouts (a linear layer's weight
``(out, in)``, a convolution's ``(out, in, k, k)``), so the optimizer sees exactly the tensors it
would see training the same model built from ``torch.nn`` modules, and chooses the same factored
axes.

**Weight-rescale augmentation** (``rescale=(lo, hi)``): each instance draws one global factor
``s`` log-uniformly in ``[lo, hi]``; the optimizer trains ``p' = p / s`` and the model computes with
``s · p'``, so the optimizer sees parameters ``1/s`` times and gradients ``s`` times their usual
size (the same network function).

**Loss normalisation** (``normalise``): the meta-objective clips a task's loss to
``[0, 1.5 · L0]`` and maps NaN and ±inf to ``1.5 · L0``, with ``L0 = ln(num_classes)`` for a
classifier (the loss of a uniform guess) and ``L0 = 1`` for the teacher–student regression (whose
targets are standardised, so 1 is the loss of predicting their mean).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lopt.meta import data as data_lib


def _uniform(shape, bound, generator, device):
    return (torch.rand(shape, generator=generator, device=device) * 2 - 1) * bound


def linear_init(n, out_features, in_features, generator, device):
    """torch.nn.Linear's initial distribution (kaiming_uniform a=√5 ≡ U(±1/√in), bias U(±1/√in)), n instances."""
    bound = 1.0 / math.sqrt(in_features)
    return (_uniform((n, out_features, in_features), bound, generator, device),
            _uniform((n, out_features), bound, generator, device))


def conv_init(n, out_channels, in_channels, kernel, generator, device):
    """torch.nn.Conv2d's initial distribution, n instances."""
    bound = 1.0 / math.sqrt(in_channels * kernel * kernel)
    return (_uniform((n, out_channels, in_channels, kernel, kernel), bound, generator, device),
            _uniform((n, out_channels), bound, generator, device))


def batched_linear(x, weight, bias):
    """x (n, B, in) → (n, B, out): every instance with its own weight (n, out, in) and bias (n, out)."""
    return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))


def mlp_forward(params, x, activation=torch.relu):
    """params [W0, b0, W1, b1, ...] (each with the instance axis), x (n, B, in)."""
    layers = len(params) // 2
    for i in range(layers):
        x = batched_linear(x, params[2 * i], params[2 * i + 1])
        if i < layers - 1:
            x = activation(x)
    return x


def classification_loss(logits, labels):
    """Mean cross-entropy per instance: logits (n, B, C), labels (n, B) → (n,)."""
    n, batch, classes = logits.shape
    return F.cross_entropy(logits.reshape(n * batch, classes), labels.reshape(n * batch),
                           reduction="none").view(n, batch).mean(1)


def log_uniform(n, low, high, generator, device):
    return torch.exp(torch.empty(n, device=device).uniform_(math.log(low), math.log(high), generator=generator))


class TaskFamily:
    """Base class. Subclasses set ``name``, ``batch_size``, ``loss_scale`` (L0) and implement
    ``shapes``, ``_init_params``, ``_sample_batch``, ``_loss`` and ``heldout_loss``."""

    name = "task"
    batch_size = 64
    loss_scale = 1.0  # L0: ln(num_classes) for a classifier

    def __init__(self, rescale=None):
        self.rescale = None if rescale is None else (float(rescale[0]), float(rescale[1]))
        self.device = torch.device("cpu")

    @property
    def max_loss(self) -> float:
        return 1.5 * self.loss_scale

    def describe(self) -> dict:
        return {"name": self.name, "shapes": [list(s) for s in self.shapes()], "batch_size": self.batch_size,
                "max_loss": self.max_loss, "rescale": self.rescale}

    def to(self, device) -> "TaskFamily":
        self.device = torch.device(device)
        return self

    def normalise(self, loss: torch.Tensor) -> torch.Tensor:
        """The meta-objective's loss: clipped to [0, 1.5·L0], NaN and ±inf → 1.5·L0."""
        top = self.max_loss
        return torch.nan_to_num(loss, nan=top, posinf=top, neginf=top).clamp(0.0, top)

    # --------------------------------------------------------------- instances
    def sample_instances(self, n: int, generator) -> dict:
        """The per-instance randomness other than the parameters (tensors with leading axis n)."""
        inst = {}
        if self.rescale is not None:
            inst["scale"] = log_uniform(n, *self.rescale, generator, self.device)
        inst.update(self._sample_instances(n, generator))
        return inst

    def _sample_instances(self, n, generator) -> dict:
        return {}

    def init_params(self, n: int, inst: dict, generator) -> list:
        """Initial parameters of n instances, divided by their rescale factor."""
        params = self._init_params(n, generator)
        if "scale" in inst:
            params = [p / inst["scale"].view((-1,) + (1,) * (p.dim() - 1)) for p in params]
        return params

    def effective(self, params, inst):
        if "scale" not in inst:
            return params
        return [p * inst["scale"].view((-1,) + (1,) * (p.dim() - 1)) for p in params]

    def sample_batch(self, inst: dict, generator):
        return self._sample_batch(_rows(inst), inst, generator)

    def loss(self, params, batch, inst) -> torch.Tensor:
        """Training loss per instance (n,), differentiable w.r.t. ``params``."""
        return self._loss(self.effective(params, inst), batch, inst)

    @torch.no_grad()
    def heldout_loss(self, params, inst, generator) -> torch.Tensor:
        """Held-out loss per instance (n,)."""
        return self._heldout(self.effective(params, inst), inst, generator)


def _rows(inst):
    for value in inst.values():
        return value.shape[0]
    raise ValueError("an instance dict needs at least one tensor")


class DatasetTask(TaskFamily):
    """A classifier on a fixed data set (train split for training, test split held out)."""

    heldout_size = 1024

    def __init__(self, dataset: str, batch_size: int = 64, rescale=None):
        super().__init__(rescale)
        self.dataset_name = dataset
        self.data = data_lib.load(dataset)
        self.batch_size = int(batch_size)
        self.loss_scale = math.log(self.data.num_classes)

    def to(self, device):
        super().to(device)
        self.data = self.data.to(device)
        return self

    def _sample_instances(self, n, generator):
        # (a tensor per instance is needed to know n; the draw also fixes the instance's data stream)
        return {"id": torch.randint(2**31 - 1, (n,), generator=generator, device=self.device)}

    def _sample_batch(self, n, inst, generator):
        index = torch.randint(len(self.data.train_x), (n, self.batch_size), generator=generator, device=self.device)
        return self.data.train_x[index], self.data.train_y[index]

    def _loss(self, params, batch, inst):
        x, y = batch
        return classification_loss(self.forward(params, x), y)

    def _heldout(self, params, inst, generator):
        x, y = self.data.test_x[: self.heldout_size], self.data.test_y[: self.heldout_size]
        n = params[0].shape[0]
        logits = self.forward(params, x.unsqueeze(0).expand((n,) + x.shape))
        return classification_loss(logits, y.unsqueeze(0).expand(n, -1))


def mlp_shapes(widths) -> list:
    """An MLP's parameter shapes for layer widths ``widths``: each layer's (out, in) weight, then its bias."""
    out = []
    for a, b in zip(widths[:-1], widths[1:]):
        out += [(b, a), (b,)]
    return out


def mlp_params(widths, n, generator, device) -> list:
    """``n`` instances of an MLP's parameters (mlp_shapes' order), torch.nn.Linear's initialisation."""
    params = []
    for a, b in zip(widths[:-1], widths[1:]):
        params += list(linear_init(n, b, a, generator, device))
    return params


class MLPClassifier(DatasetTask):
    """An MLP (ReLU) on a data set's flattened inputs."""

    def __init__(self, dataset: str, hidden=(32,), batch_size: int = 64, rescale=None):
        super().__init__(dataset, batch_size, rescale)
        self.hidden = tuple(int(h) for h in hidden)
        self.widths = (math.prod(self.data.input_shape),) + self.hidden + (self.data.num_classes,)
        self.name = f"{dataset}_mlp_{'x'.join(map(str, self.hidden)) or 'linear'}"

    def shapes(self):
        return mlp_shapes(self.widths)

    def _init_params(self, n, generator):
        return mlp_params(self.widths, n, generator, self.device)

    def forward(self, params, x):
        return mlp_forward(params, x.reshape(x.shape[0], x.shape[1], -1))


class CNNClassifier(DatasetTask):
    """Convolutions (3×3, padding 1, ReLU), global average pooling, a linear head; inputs (C, H, W)."""

    def __init__(self, dataset: str, channels=(16, 32), batch_size: int = 64, rescale=None):
        super().__init__(dataset, batch_size, rescale)
        self.channels = (self.data.input_shape[0],) + tuple(int(c) for c in channels)
        self.name = f"{dataset}_cnn_{'x'.join(map(str, channels))}"

    def shapes(self):
        out = []
        for a, b in zip(self.channels[:-1], self.channels[1:]):
            out += [(b, a, 3, 3), (b,)]
        return out + [(self.data.num_classes, self.channels[-1]), (self.data.num_classes,)]

    def _init_params(self, n, generator):
        params = []
        for a, b in zip(self.channels[:-1], self.channels[1:]):
            params += list(conv_init(n, b, a, 3, generator, self.device))
        return params + list(linear_init(n, self.data.num_classes, self.channels[-1], generator, self.device))

    def forward(self, params, x):
        n, batch = x.shape[:2]
        h = x.transpose(0, 1).reshape((batch, n * x.shape[2]) + tuple(x.shape[3:]))  # instances as conv groups
        for i in range(len(self.channels) - 1):
            weight, bias = params[2 * i], params[2 * i + 1]
            h = torch.relu(F.conv2d(h, weight.reshape((-1,) + tuple(weight.shape[2:])), bias.reshape(-1),
                                    padding=1, groups=n))
        pooled = h.mean(dim=(2, 3)).view(batch, n, -1).transpose(0, 1)
        return batched_linear(pooled, params[-2], params[-1])


class TeacherStudent(TaskFamily):
    """Regression onto a random teacher MLP (tanh) from x ~ N(0, I): a student MLP (ReLU) of its own
    width and depth; targets standardised per instance (from 512 probe inputs), MSE loss, L0 = 1."""

    def __init__(self, in_dim=16, out_dim=4, teacher_hidden=(32, 32), student_hidden=(32,), batch_size=64,
                 rescale=None):
        super().__init__(rescale)
        self.in_dim, self.out_dim = int(in_dim), int(out_dim)
        self.teacher_widths = (self.in_dim,) + tuple(int(h) for h in teacher_hidden) + (self.out_dim,)
        self.widths = (self.in_dim,) + tuple(int(h) for h in student_hidden) + (self.out_dim,)
        self.batch_size = int(batch_size)
        self.loss_scale = 1.0
        self.name = (f"teacher_student_{in_dim}to{out_dim}_t{'x'.join(map(str, teacher_hidden))}"
                     f"_s{'x'.join(map(str, student_hidden))}")

    def shapes(self):
        return mlp_shapes(self.widths)

    def _init_params(self, n, generator):
        return mlp_params(self.widths, n, generator, self.device)

    def _sample_instances(self, n, generator):
        inst = {}
        for i, (a, b) in enumerate(zip(self.teacher_widths[:-1], self.teacher_widths[1:])):
            inst[f"teacher_w{i}"] = torch.randn((n, b, a), generator=generator, device=self.device) * (1.5 / math.sqrt(a))
            inst[f"teacher_b{i}"] = torch.randn((n, b), generator=generator, device=self.device) * 0.1
        probe = torch.randn((n, 512, self.in_dim), generator=generator, device=self.device)
        raw = self._teacher(inst, probe)
        inst["target_mean"] = raw.mean(1)
        inst["target_std"] = raw.std(1).clamp_min(1e-3)
        return inst

    def _teacher(self, inst, x):
        layers = len(self.teacher_widths) - 1
        for i in range(layers):
            x = batched_linear(x, inst[f"teacher_w{i}"], inst[f"teacher_b{i}"])
            if i < layers - 1:
                x = torch.tanh(x)
        return x

    def _targets(self, inst, x):
        return (self._teacher(inst, x) - inst["target_mean"].unsqueeze(1)) / inst["target_std"].unsqueeze(1)

    def _sample_batch(self, n, inst, generator):
        x = torch.randn((n, self.batch_size, self.in_dim), generator=generator, device=self.device)
        return x, self._targets(inst, x)

    def _loss(self, params, batch, inst):
        x, y = batch
        return ((mlp_forward(params, x) - y) ** 2).mean(dim=(1, 2))

    def _heldout(self, params, inst, generator):
        n = params[0].shape[0]
        x = torch.randn((n, 1024, self.in_dim), generator=generator, device=self.device)
        return ((mlp_forward(params, x) - self._targets(inst, x)) ** 2).mean(dim=(1, 2))


class LogisticRegression(TaskFamily):
    """Multinomial logistic regression on Gaussian classes: per instance, class means ~ N(0, sep²/dim · I),
    x = mean[y] + N(0, I); a linear model (classes, dim) + bias."""

    def __init__(self, dim=16, classes=4, separation=3.0, batch_size=64, rescale=None):
        super().__init__(rescale)
        self.dim, self.classes, self.separation = int(dim), int(classes), float(separation)
        self.batch_size = int(batch_size)
        self.loss_scale = math.log(self.classes)
        self.name = f"logreg_{dim}d_{classes}c"

    def shapes(self):
        return [(self.classes, self.dim), (self.classes,)]

    def _init_params(self, n, generator):
        return list(linear_init(n, self.classes, self.dim, generator, self.device))

    def _sample_instances(self, n, generator):
        means = torch.randn((n, self.classes, self.dim), generator=generator, device=self.device)
        return {"means": means * (self.separation / math.sqrt(self.dim))}

    def _draw(self, inst, count, generator):
        n = inst["means"].shape[0]
        labels = torch.randint(self.classes, (n, count), generator=generator, device=self.device)
        centres = torch.gather(inst["means"], 1, labels.unsqueeze(-1).expand(n, count, self.dim))
        return centres + torch.randn((n, count, self.dim), generator=generator, device=self.device), labels

    def _sample_batch(self, n, inst, generator):
        return self._draw(inst, self.batch_size, generator)

    def _loss(self, params, batch, inst):
        x, y = batch
        return classification_loss(batched_linear(x, params[0], params[1]), y)

    def _heldout(self, params, inst, generator):
        x, y = self._draw(inst, 1024, generator)
        return classification_loss(batched_linear(x, params[0], params[1]), y)


class CharTransformer(TaskFamily):
    """A pre-LayerNorm causal transformer language model over the bytes of a standard-library module's
    source (``data.stdlib_text``): learned token and position embeddings, ``layers`` blocks of
    attention (``heads`` heads) and a 4× MLP (GELU), a final LayerNorm and an untied head."""

    def __init__(self, module="argparse", width=64, layers=2, heads=4, context=64, batch_size=32, rescale=None):
        super().__init__(rescale)
        self.data = data_lib.stdlib_text(module)
        self.width, self.layers, self.heads, self.context = int(width), int(layers), int(heads), int(context)
        self.batch_size = int(batch_size)
        self.vocab = self.data.num_classes
        self.loss_scale = math.log(self.vocab)
        self.name = f"char_transformer_{module}_{layers}x{width}"

    def to(self, device):
        super().to(device)
        self.data = self.data.to(device)
        return self

    def shapes(self):
        d, v = self.width, self.vocab
        out = [(v, d), (self.context, d)]
        for _ in range(self.layers):
            out += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
        return out + [(d,), (d,), (v, d)]

    def _init_params(self, n, generator):
        d, v, dev = self.width, self.vocab, self.device
        params = [torch.randn((n, v, d), generator=generator, device=dev) * 0.02,
                  torch.randn((n, self.context, d), generator=generator, device=dev) * 0.02]
        for _ in range(self.layers):
            params += [torch.ones((n, d), device=dev), torch.zeros((n, d), device=dev)]
            params += list(linear_init(n, 3 * d, d, generator, dev)) + list(linear_init(n, d, d, generator, dev))
            params += [torch.ones((n, d), device=dev), torch.zeros((n, d), device=dev)]
            params += list(linear_init(n, 4 * d, d, generator, dev)) + list(linear_init(n, d, 4 * d, generator, dev))
        return params + [torch.ones((n, d), device=dev), torch.zeros((n, d), device=dev),
                         linear_init(n, v, d, generator, dev)[0]]

    def _sample_instances(self, n, generator):
        return {"id": torch.randint(2**31 - 1, (n,), generator=generator, device=self.device)}

    def _windows(self, tokens, n, count, generator):
        starts = torch.randint(len(tokens) - self.context - 1, (n, count), generator=generator, device=self.device)
        index = starts.unsqueeze(-1) + torch.arange(self.context + 1, device=self.device)
        windows = tokens[index]
        return windows[..., :-1], windows[..., 1:]

    def _sample_batch(self, n, inst, generator):
        return self._windows(self.data.train_x, n, self.batch_size, generator)

    def forward(self, params, tokens):
        n, batch, length = tokens.shape
        d, heads = self.width, self.heads

        def norm(h, w, b):
            return F.layer_norm(h, (d,)) * w.view(n, 1, 1, d) + b.view(n, 1, 1, d)

        def dense(h, w, b):  # h (n, batch, length, in)
            return batched_linear(h.reshape(n, batch * length, -1), w, b).view(n, batch, length, -1)

        rows = torch.arange(n, device=tokens.device).view(n, 1, 1)
        h = params[0][rows, tokens] + params[1][:, :length].unsqueeze(1)
        i = 2
        for _ in range(self.layers):
            ln1w, ln1b, qkvw, qkvb, projw, projb, ln2w, ln2b, fcw, fcb, outw, outb = params[i:i + 12]
            i += 12
            qkv = dense(norm(h, ln1w, ln1b), qkvw, qkvb).view(n * batch, length, 3, heads, d // heads)
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
            attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + dense(attention.transpose(1, 2).reshape(n, batch, length, d), projw, projb)
            h = h + dense(F.gelu(dense(norm(h, ln2w, ln2b), fcw, fcb)), outw, outb)
        h = norm(h, params[i], params[i + 1])
        return torch.bmm(h.reshape(n, batch * length, d), params[i + 2].transpose(1, 2)).view(n, batch, length, -1)

    def _loss(self, params, batch, inst):
        x, y = batch
        logits = self.forward(params, x)
        n = x.shape[0]
        return classification_loss(logits.reshape(n, -1, self.vocab), y.reshape(n, -1))

    def _heldout(self, params, inst, generator):
        n = params[0].shape[0]
        x, y = self._windows(self.data.test_x, 1, 64, generator)
        x, y = x.expand(n, -1, -1), y.expand(n, -1, -1)
        logits = self.forward(params, x)
        return classification_loss(logits.reshape(n, -1, self.vocab), y.reshape(n, -1))


TASKS = {"mlp": MLPClassifier, "cnn": CNNClassifier, "teacher_student": TeacherStudent,
         "logreg": LogisticRegression, "char_transformer": CharTransformer}


def build(spec: dict) -> TaskFamily:
    """A family from a spec ``{"task": name, **arguments}`` (the form presets and records use)."""
    spec = dict(spec)
    kind = spec.pop("task")
    if kind not in TASKS:
        raise ValueError(f"unknown task {kind!r}; known: {sorted(TASKS)}")
    return TASKS[kind](**spec)
