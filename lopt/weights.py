"""Meta-weights of learned optimizers: the registry, the Hugging Face hub, safetensors files.

A learned optimizer's meta-network is frozen data. This module finds it, checks it and hands it
to an optimizer as float32 tensors:

* The **registry** (``weights/registry.json``, shipped as ``lopt._registry``) names each
  *architecture* (its components, their ``config.json`` and the exact tensor names and shapes) and
  each *published weight set* (hub repository, revision, file sizes and sha256 where known), or
  a weight set that *ships with lopt* (``path``: a directory beside the registry, read offline).
* ``load_weights(source, architecture)`` accepts a registered name, a hub repo id
  (``owner/name`` or ``owner/name@revision``), a local directory in PyLO's hub layout
  (``config.json`` + ``model.safetensors``, as ``PyTorchModelHubMixin.save_pretrained`` writes
  it), a local ``.safetensors`` file, an already loaded :class:`MetaWeights`, or (for
  architectures with several components, such as VeLO) a tuple/dict of such sources, one per
  component.
* Downloads go through ``huggingface_hub`` (its cache, ``HF_HOME``, ``HF_HUB_OFFLINE``; with
  ``HF_HUB_OFFLINE`` set only the cache is read, without network attempts); tensors load through
  ``safetensors``. ``download(name_or_repo_id)`` fills the cache (``lopt weights download``);
  ``verify(source)`` checks a source, VeLO's two directories as a pair.
* Every failure raises :class:`WeightsError` naming the problem and the fix, and nothing is
  half-loaded: a :class:`MetaWeights` exists only once every check passed. A string that is
  neither an existing path nor a registered name is tried as a hub repo id only if it is a valid
  one; when the hub cannot provide it either, the message says both.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Union

import torch

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

WeightsSource = Union[str, os.PathLike, "MetaWeights", tuple, list, Mapping]


from lopt.errors import UntrainedWeightsWarning, WeightsError  # noqa: E402,F401  (raised and warned here)


def warn_if_untrained(weights: "MetaWeights", owner: str, *, default: str | None = None, stacklevel: int = 4) -> None:
    """One :class:`UntrainedWeightsWarning` when ``weights`` are not pretrained (called at an optimizer's construction;
    ``default``: the weight set the owner's constructor loads where weights= is left out, else the architecture's name)."""
    if not weights.pretrained:
        import warnings

        shipped = shipped_weights(weights.architecture)
        offline = f" (or pass weights={shipped[0]!r}, shipped with lopt: it trains offline)" if shipped else ""
        warnings.warn(
            f"{owner}: the meta-weights are untrained ({weights.source}): its steps can be timed, but it does not "
            f"train a model. Leave weights= out for the published {default or weights.architecture} weights{offline}; where "
            f"untrained weights are intended, silence this with "
            f"warnings.filterwarnings('ignore', category=lopt.UntrainedWeightsWarning)",
            UntrainedWeightsWarning, stacklevel=stacklevel)


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ComponentSpec:
    """One network of an architecture: its ``config.json`` and its exact tensors."""

    name: str
    config: dict
    tensors: dict  # tensor name -> shape tuple
    ignored_tensors: tuple = ()  # names a published file may carry that are not meta-weights
    # config fields a weights file may set otherwise (an MLP's hidden_size and hidden_layers): the tensors
    # then follow from the file's config (lopt.network.MLPGeometry); the registered config is the default
    variable: tuple = ()

    def for_config(self, config: dict, where: str = "the config") -> "ComponentSpec":
        """This network as ``config`` describes it (itself where nothing variable differs)."""
        if not self.variable or all(config.get(key, self.config[key]) == self.config[key] for key in self.variable):
            return self
        from lopt.network import MLPGeometry

        merged = {**self.config, **{key: config[key] for key in self.variable if key in config}}
        try:
            geometry = MLPGeometry.from_config(merged, outputs=self.tensors["network.output.weight"][0])
        except (ValueError, TypeError) as err:
            raise WeightsError(f"{where} describes an MLP lopt cannot run: {err}") from None
        return ComponentSpec(self.name, merged, geometry.tensor_shapes(), self.ignored_tensors, self.variable)

    def config_of_tensors(self, tensors: Mapping) -> dict:
        """The config a bare weights file (no config.json) describes by its tensors' shapes (variable fields only)."""
        if not self.variable or not all(isinstance(tensors.get(f"network.{layer}.weight"), torch.Tensor)
                                        for layer in ("input", "output")):
            return dict(self.config)
        from lopt.network import MLPGeometry

        geometry = MLPGeometry.of({k: v for k, v in tensors.items() if k.startswith("network.")})
        return {**self.config, **{key: geometry.config()[key] for key in self.variable}}


@dataclass(frozen=True)
class ArchitectureSpec:
    name: str
    description: str
    components: dict  # component name -> ComponentSpec


@dataclass(frozen=True)
class PublishedComponent:
    """Where one network of a registered weight set lives: a hub repository, or (``path``) a directory
    shipped inside lopt itself, relative to the registry (``weights/``, installed as ``lopt/_registry``)."""

    repo_id: str | None
    revision: str
    files: dict  # file name -> {"size": int, "sha256": str} or None when unknown
    path: str | None = None  # shipped with lopt: read from the package, never from the hub

    @property
    def shipped(self) -> bool:
        return self.path is not None

    def directory(self) -> Path:
        """The shipped files' directory (``path`` under the registry's directory)."""
        return _registry_dir() / self.path

    def location(self) -> str:
        """``repo_id@revision``, or ``lopt/_registry/PATH (ships with lopt)``."""
        return f"lopt/_registry/{self.path} (ships with lopt)" if self.shipped else f"{self.repo_id}@{self.revision}"


@dataclass(frozen=True)
class RegisteredWeights:
    name: str
    architecture: str
    description: str
    components: dict  # component name -> PublishedComponent


def _registry_dir() -> Path:
    """weights/: shipped in an installed package as lopt/_registry, else the source tree's (an editable install)."""
    package = Path(__file__).resolve().parent
    installed = package / "_registry"
    return installed if (installed / "registry.json").is_file() else package.parent / "weights"


def _read_registry_file() -> dict:
    """weights/registry.json (see :func:`_registry_dir`)."""
    return json.loads((_registry_dir() / "registry.json").read_text())


def _parse_component(where: str, comp: dict) -> PublishedComponent:
    if ("repo_id" in comp) == ("path" in comp):
        raise WeightsError(f"weights/registry.json: {where} needs exactly one of repo_id (the hub) and path (shipped "
                           f"with lopt)")
    return PublishedComponent(comp.get("repo_id"), comp.get("revision", "main"), dict(comp["files"]), comp.get("path"))


def _parse_registry(data: dict) -> tuple[dict, dict]:
    architectures = {}
    for arch_name, arch in data["architectures"].items():
        components = {
            comp_name: ComponentSpec(
                name=comp_name,
                config=dict(comp["config"]),
                tensors={t: tuple(s) for t, s in comp["tensors"].items()},
                ignored_tensors=tuple(comp.get("ignored_tensors", ())),
                variable=tuple(comp.get("variable", ())),
            )
            for comp_name, comp in arch["components"].items()
        }
        architectures[arch_name] = ArchitectureSpec(arch_name, arch.get("description", ""), components)
    published = {}
    for name, entry in data["weights"].items():
        components = {comp_name: _parse_component(f"{name}/{comp_name}", comp)
                      for comp_name, comp in entry["components"].items()}
        published[name] = RegisteredWeights(name, entry["architecture"], entry.get("description", ""), components)
    return architectures, published


_ARCHITECTURES, _REGISTERED = _parse_registry(_read_registry_file())


def architectures() -> dict[str, ArchitectureSpec]:
    """The known learned-optimizer architectures, by name."""
    return dict(_ARCHITECTURES)


def architecture(name: str) -> ArchitectureSpec:
    try:
        return _ARCHITECTURES[name]
    except KeyError:
        raise WeightsError(f"unknown learned-optimizer architecture {name!r}; known: {sorted(_ARCHITECTURES)}") from None


def registered_weights() -> dict[str, RegisteredWeights]:
    """The registered (published or shipped) weight sets, by name."""
    return dict(_REGISTERED)


def shipped_weights(architecture_name: str) -> list[str]:
    """The registered weight sets of ``architecture_name`` whose files ship with lopt (they load offline)."""
    return [name for name, entry in _REGISTERED.items() if entry.architecture == architecture_name
            and all(c.shipped for c in entry.components.values())]


def register_weights(entry: RegisteredWeights, *, overwrite: bool = False) -> None:
    """Add a weight set to the registry of this process (e.g. your own meta-trained weights on the hub)."""
    architecture(entry.architecture)
    if entry.name in _REGISTERED and not overwrite:
        raise WeightsError(f"weights {entry.name!r} are already registered; pass overwrite=True to replace them")
    missing = set(architecture(entry.architecture).components) - set(entry.components)
    if missing:
        raise WeightsError(f"registered weights {entry.name!r} lack components {sorted(missing)}")
    _REGISTERED[entry.name] = entry


def unregister_weights(name: str) -> None:
    _REGISTERED.pop(name, None)


# --------------------------------------------------------------------------------------------
# Loaded weights
# --------------------------------------------------------------------------------------------


@dataclass
class MetaWeights:
    """Validated float32 meta-weights of one architecture.

    ``tensors[component][tensor_name]`` is a float32 tensor of the registered shape;
    ``configs[component]`` is the component's ``config.json`` content; ``source`` says where the
    weights came from (shown by the CLI and in error messages); ``pretrained`` is False for
    randomly initialised weights (timing only).
    """

    architecture: str
    tensors: dict
    configs: dict
    source: str
    pretrained: bool = True

    def to(self, device) -> "MetaWeights":
        moved = {c: {k: v.to(device) for k, v in ts.items()} for c, ts in self.tensors.items()}
        return MetaWeights(self.architecture, moved, copy.deepcopy(self.configs), self.source, self.pretrained)

    def save(self, destination) -> list[Path]:
        """Write PyLO's hub layout (``config.json`` + ``model.safetensors``).

        ``destination`` is a directory for a one-component architecture, or a mapping
        ``{component: directory}`` / a sequence of directories in component order otherwise.
        Returns the directories written. ``load_weights`` of them gives back identical tensors.
        """
        from safetensors.torch import save_file

        targets = _per_component(destination, self.architecture, what="destination")
        written = []
        for comp_name, directory in targets.items():
            directory = Path(directory)
            directory.mkdir(parents=True, exist_ok=True)
            (directory / CONFIG_FILE).write_text(json.dumps(self.configs[comp_name], indent=2) + "\n")
            tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in self.tensors[comp_name].items()}
            save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
            written.append(directory)
        return written


def random_weights(architecture_name: str, seed: int = 0, **config) -> MetaWeights:
    """Randomly initialised weights of the registered shapes (for timing and tests, not training).

    Matrices (and stacks of matrices) draw U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan_in = the
    last dimension, as ``torch.nn.Linear`` does; vectors draw U(-1/sqrt(n), 1/sqrt(n)). ``config``
    sets what the architecture lets a weights file choose, e.g. ``random_weights("small_fc_lopt",
    hidden_size=8, hidden_layers=2)`` for another geometry of small_fc_lopt's MLP.
    """
    spec = architecture(architecture_name)
    settable = {key for comp in spec.components.values() for key in comp.variable}
    unknown = sorted(set(config) - settable)
    if unknown:
        raise WeightsError(f"random_weights({architecture_name!r}): {unknown} cannot be chosen; "
                           f"{architecture_name} lets weights choose {sorted(settable) or 'nothing'}")
    generator = torch.Generator().manual_seed(seed)
    tensors, configs = {}, {}
    for comp_name, comp in spec.components.items():
        comp = comp.for_config({**comp.config, **{k: v for k, v in config.items() if k in comp.variable}},
                               f"random_weights({architecture_name!r}, {config})")
        configs[comp_name] = dict(comp.config)
        tensors[comp_name] = {}
        for tensor_name, shape in comp.tensors.items():
            fan_in = shape[-1] if len(shape) else 1
            bound = 1.0 / math.sqrt(max(fan_in, 1))
            tensors[comp_name][tensor_name] = (torch.rand(shape, generator=generator) * 2 - 1) * bound
    return MetaWeights(architecture_name, tensors, configs, source=f"random (seed {seed})", pretrained=False)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_weights(source: WeightsSource, architecture_name: str, *, verify_checksum: bool = True) -> MetaWeights:
    """Find, load and validate the meta-weights of ``architecture_name`` from ``source``.

    See the module docstring for the accepted sources. Raises :class:`WeightsError` on any
    problem; never returns partially loaded weights.
    """
    spec = architecture(architecture_name)
    if source is None:
        registered = sorted(n for n, r in _REGISTERED.items() if r.architecture == architecture_name)
        published = [n for n in registered if n not in shipped_weights(architecture_name)]
        default = f" ({published[0]!r})" if published else ""
        raise WeightsError(
            f"weights=None: {architecture_name} needs meta-weights. Leave weights out for the published ones{default}, "
            f"or pass\n  a registered name ({registered}), a hub repo id {REPO_ID_FORM}, a local directory with "
            f"{CONFIG_FILE} + {WEIGHTS_FILE},\n  a .safetensors file, or lopt.random_weights({architecture_name!r}) "
            f"(untrained, for timing only)")
    if isinstance(source, MetaWeights):
        if source.architecture != architecture_name:
            raise WeightsError(
                f"these meta-weights are for {source.architecture!r}, not {architecture_name!r}; "
                f"load weights of the {architecture_name} architecture"
            )
        tensors = {c: _validate_tensors(spec.components[c].for_config(source.configs.get(c, {}), source.source),
                                        source.tensors.get(c, {}), source.source) for c in spec.components}
        return MetaWeights(architecture_name, tensors, copy.deepcopy(source.configs), source.source, source.pretrained)

    if isinstance(source, str) and source in _REGISTERED:
        return _load_registered(_REGISTERED[source], spec, verify_checksum)

    if isinstance(source, (str, os.PathLike)) and len(spec.components) == 1:
        (comp_name,) = spec.components
        return _assemble(spec, {comp_name: _load_component(spec.components[comp_name], source)}, str(source))

    if isinstance(source, (str, os.PathLike)):
        raise WeightsError(
            f"{architecture_name} has {len(spec.components)} networks ({', '.join(spec.components)}): pass a registered "
            f"name (one of {sorted(n for n, r in _REGISTERED.items() if r.architecture == architecture_name)}), "
            f"or one source per network as a tuple or dict, not the single source {str(source)!r}"
        )
    per_component = _per_component(source, architecture_name, what="weights")
    loaded = {c: _load_component(spec.components[c], src) for c, src in per_component.items()}
    return _assemble(spec, loaded, ", ".join(f"{c}={s}" for c, s in per_component.items()))


def _per_component(value, architecture_name: str, *, what: str) -> dict:
    spec = architecture(architecture_name)
    names = list(spec.components)
    if isinstance(value, Mapping):
        unknown = set(value) - set(names)
        missing = set(names) - set(value)
        if unknown or missing:
            raise WeightsError(
                f"{what} for {architecture_name} must name exactly the networks {names}; "
                f"missing {sorted(missing)}, unknown {sorted(unknown)}"
            )
        return {c: value[c] for c in names}
    if isinstance(value, (tuple, list)):
        if len(value) != len(names):
            raise WeightsError(f"{what} for {architecture_name} needs {len(names)} entries, one per network {names}; got {len(value)}")
        return dict(zip(names, value))
    if len(names) == 1:
        return {names[0]: value}
    raise WeightsError(f"{what} for {architecture_name} needs one entry per network {names}, as a tuple or dict")


def _assemble(spec: ArchitectureSpec, loaded: dict, source: str) -> MetaWeights:
    tensors = {c: t for c, (t, _) in loaded.items()}
    configs = {c: cfg for c, (_, cfg) in loaded.items()}
    return MetaWeights(spec.name, tensors, configs, source)


def _load_registered(entry: RegisteredWeights, spec: ArchitectureSpec, verify_checksum: bool) -> MetaWeights:
    if entry.architecture != spec.name:
        raise WeightsError(
            f"registered weights {entry.name!r} are for {entry.architecture!r}, not {spec.name!r}; "
            f"pass weights of the {spec.name} architecture"
        )
    loaded = {}
    for comp_name, published in entry.components.items():
        if published.shipped:
            directory = _shipped_component(entry.name, published, verify_checksum)
        else:
            directory = _download_component(entry.name, published, verify_checksum, architecture_name=spec.name)
        loaded[comp_name] = _load_component(spec.components[comp_name], directory)
    source = ", ".join(p.location() for p in entry.components.values())
    return _assemble(spec, loaded, f"{entry.name} ({source})")


def _shipped_component(label: str, published: PublishedComponent, verify_checksum: bool) -> Path:
    """The directory of a component that ships with lopt, its files checked against the registry."""
    directory = published.directory()
    for filename, expected in published.files.items():
        local = directory / filename
        if not local.is_file():
            raise WeightsError(f"{local} is missing: {label!r} ships with lopt, but this installation lacks its "
                               f"files; reinstall lopt")
        if verify_checksum and expected:
            size, sha = local.stat().st_size, (_sha256(local) if expected.get("sha256") else None)
            if ("size" in expected and size != expected["size"]) or (sha is not None and sha != expected["sha256"]):
                raise WeightsError(f"{local} ({size} bytes, sha256 {sha}) is not the file registered for {label!r} "
                                   f"({expected.get('size')} bytes, sha256 {expected.get('sha256')}); reinstall lopt")
    return directory


REPO_ID_FORM = "owner/name[@revision]"


def _split_revision(repo: str) -> tuple[str, str | None]:
    if "@" in repo:
        repo_id, revision = repo.split("@", 1)
        return repo_id, revision or None
    return repo, None


def _repo_id_problem(text: str) -> str | None:
    """Why ``text`` is not a hub repo id ``owner/name[@revision]``, or None when it is one (checked locally)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo_id, _ = _split_revision(text)
    if repo_id.count("/") != 1:
        return f"a repo id has exactly one '/', {repo_id!r} has {repo_id.count('/')}"
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        return str(err)
    return None


def _convert_command(pickle_path: Path, target: Path) -> str:
    """A shell command that turns a torch.save'd state dict into a safetensors file.

    The file is opened by hand: torch.load given a path ending in .safetensors reads it as safetensors.
    """
    return (f"python3 -c \"import torch, safetensors.torch as st; "
            f"st.save_file(torch.load(open({str(pickle_path)!r}, 'rb')), {str(target)!r})\"")


def _load_component(comp: ComponentSpec, source) -> tuple[dict, dict]:
    """Load one component from a local directory, a local .safetensors file or a hub repo id."""
    if not isinstance(source, (str, os.PathLike)):
        raise WeightsError(f"weights for the {comp.name} network must be a path or a hub repo id, got "
                           f"{type(source).__name__} {source!r}")
    path = Path(os.path.expanduser(str(source)))
    if path.is_dir():
        weights_path = path / WEIGHTS_FILE
        if weights_path.is_dir():
            nested = (f"; it holds a {WEIGHTS_FILE} itself: pass {weights_path} instead"
                      if (weights_path / WEIGHTS_FILE).is_file() else "")
            raise WeightsError(f"{weights_path} is a directory, not a safetensors file{nested}.\nPyLO's hub layout is a "
                               f"directory holding the files {CONFIG_FILE} and {WEIGHTS_FILE}")
        if path.suffix == ".safetensors" and not weights_path.exists():
            raise WeightsError(f"{path} is a directory, not a .safetensors file; pass the file itself, or a directory "
                               f"holding {CONFIG_FILE} + {WEIGHTS_FILE}")
        if not weights_path.is_file():
            pickled = path / "pytorch_model.bin"
            bin_hint = f" (it has pytorch_model.bin: convert it with {_convert_command(pickled, weights_path)})" if pickled.is_file() else ""
            raise WeightsError(f"{path} has no {WEIGHTS_FILE}{bin_hint}; expected PyLO's hub layout: {CONFIG_FILE} + {WEIGHTS_FILE}")
        if (path / CONFIG_FILE).is_dir():
            raise WeightsError(f"{path / CONFIG_FILE} is a directory, not a JSON file; remove it or replace it with "
                               f"the {CONFIG_FILE} of the published weights")
        tensors = _read_safetensors(weights_path)
        config = (_read_config(path / CONFIG_FILE, comp) if (path / CONFIG_FILE).exists()
                  else comp.config_of_tensors(tensors))
        return _validate_tensors(comp.for_config(config, str(path / CONFIG_FILE)), tensors, str(weights_path)), config
    if path.is_file():
        tensors = _read_safetensors(path)
        config = comp.config_of_tensors(tensors)
        return _validate_tensors(comp.for_config(config, str(path)), tensors, str(path)), config
    if path.suffix == ".safetensors":
        looked_for = "" if path.is_absolute() else f" (looked for {path.absolute()})"
        raise WeightsError(f"weights file {path} does not exist{looked_for}")
    if not isinstance(source, str):  # a Path object is a local path, never a repo id
        raise WeightsError(f"no directory or file {path.absolute()} exists; pass a directory with {CONFIG_FILE} + "
                           f"{WEIGHTS_FILE} or a .safetensors file")
    problem = _repo_id_problem(source)
    if problem is not None:
        raise WeightsError(
            f"cannot find meta-weights {source!r}: no local directory or file {path.absolute()} exists,\n"
            f"it is not a registered name ({sorted(_REGISTERED)}),\n"
            f"and it is not a valid hub repo id {REPO_ID_FORM} ({problem}).\n"
            f"Pass an existing directory with {CONFIG_FILE} + {WEIGHTS_FILE}, a .safetensors file, a registered name "
            f"or a hub repo id"
        )
    # Every repo id is also a valid relative path: if the hub cannot provide it either, say both.
    repo_id, revision = _split_revision(source)
    published = PublishedComponent(repo_id, revision or "main", {CONFIG_FILE: None, WEIGHTS_FILE: None})
    try:
        directory = _download_component(source, published, verify_checksum=False,
                                        architecture_name=_architecture_of(comp))
    except WeightsError as err:
        raise WeightsError(
            f"cannot find meta-weights {source!r}: no local directory or file {path.absolute()} exists,\n"
            f"and as a hub repo id: {err}"
        ) from None
    return _load_component(comp, directory)


def _architecture_of(comp: ComponentSpec) -> str | None:
    return next((spec.name for spec in _ARCHITECTURES.values() if any(c is comp for c in spec.components.values())), None)


def _read_config(path: Path, comp: ComponentSpec) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise WeightsError(f"{path} is not valid JSON ({err}); replace it with the config.json of the published weights") from None
    if not isinstance(config, dict):
        raise WeightsError(f"{path} must hold a JSON object, got {type(config).__name__}")
    wrong = {k: (config[k], v) for k, v in comp.config.items()
             if k in config and config[k] != v and k not in comp.variable}
    if wrong:
        details = ", ".join(f"{k}={got!r} (lopt needs {want!r})" for k, (got, want) in wrong.items())
        raise WeightsError(f"{path} describes a different network: {details}; these weights do not fit this architecture")
    return config


def _not_safetensors(path: Path) -> tuple[str, str] | None:
    """(what ``path`` is, how to fix it) when it is certainly not a safetensors file; None when it may be one.

    A safetensors file starts with the header's length (8 bytes, little-endian) followed by the
    JSON header, which begins with ``{``. Files too short to tell are left to the reader (which
    reports them as truncated).
    """
    with open(path, "rb") as f:
        head = f.read(64)
    convert = f"convert it in place with {_convert_command(path, path)}"
    if head[8:9] == b"{":  # (a header length whose low byte is 0x80 must not read as a pickle's opcode)
        return None
    if head.startswith(b"PK\x03\x04"):
        return "it is a zip archive, the format torch.save writes (a PyTorch checkpoint)", convert
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "it is a Python pickle (a PyTorch checkpoint written by an older torch.save)", convert
    if head.startswith(b"version https://git-lfs"):
        return ("it is a Git LFS pointer, not the file's content",
                "fetch the real file (`git lfs pull` in the clone, or download the repository through the Hugging Face hub)")
    if len(head) > 8 and head[8:9] != b"{":
        header_length = int.from_bytes(head[:8], "little")
        return (f"its first 8 bytes give a header length of {header_length} bytes (the file has {path.stat().st_size}) "
                f"and no JSON header follows", "pass a file written by safetensors (e.g. by MetaWeights.save)")
    return None


def _read_safetensors(path: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    wrong_format = _not_safetensors(path)
    if wrong_format is not None:
        what, fix = wrong_format
        raise WeightsError(f"{path} is not a safetensors file: {what}; {fix}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise WeightsError(
            f"{path} is not a readable safetensors file ({err}); it is probably truncated or corrupt: "
            f"delete it and download or save it again"
        ) from None


def _validate_tensors(comp: ComponentSpec, tensors: Mapping, where: str) -> dict:
    missing = [n for n in comp.tensors if n not in tensors]
    unexpected = [n for n in tensors if n not in comp.tensors and n not in comp.ignored_tensors]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if unexpected:
            parts.append(f"unexpected {unexpected}")
        raise WeightsError(
            f"{where} does not hold the {comp.name} network lopt expects: {'; '.join(parts)} "
            f"(expected exactly {list(comp.tensors)}); are these weights for another optimizer?"
        )
    validated = {}
    for name, shape in comp.tensors.items():
        tensor = tensors[name]
        if not isinstance(tensor, torch.Tensor):
            raise WeightsError(f"{where}: {name} is a {type(tensor).__name__}, not a tensor")
        if tuple(tensor.shape) != tuple(shape):
            raise WeightsError(f"{where}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
        if not tensor.is_floating_point():
            raise WeightsError(f"{where}: tensor {name} has dtype {tensor.dtype}, expected a floating-point dtype")
        tensor = tensor.detach().to(torch.float32).clone()
        if not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            raise WeightsError(f"{where}: tensor {name} has {bad} non-finite values (NaN or inf); the file is corrupt")
        validated[name] = tensor
    return validated


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fix_lines(label: str, architecture_name: str | None, *, offline: bool) -> str:
    """What to do when the hub cannot provide weights that are not cached: one option a line."""
    arch = repr(architecture_name) if architecture_name else "ARCHITECTURE"
    lines = [f"run `lopt weights download {label}` on a machine with internet and copy its HF cache (HF_HOME) here",
             f"or pass weights=<a local directory with {CONFIG_FILE} + {WEIGHTS_FILE}, or a .safetensors file>"]
    if not offline:
        lines.append("once the cache is filled, set HF_HUB_OFFLINE=1: lopt then reads it without trying the network")
    shipped = shipped_weights(architecture_name) if architecture_name else []
    if shipped:
        lines.append(f"or weights={shipped[0]!r}: lopt's own meta-trained weights, shipped with it, train offline")
    lines.append(f"for timing only: weights=lopt.random_weights({arch}) (untrained: it does not train)")
    return "Fix:\n" + "\n".join(f"  - {line}" for line in lines)


def _http_status(err: BaseException) -> int | None:
    """The HTTP status the hub answered with, if ``err`` (or what caused it) is an HTTP error."""
    from huggingface_hub import errors as hub_errors

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, hub_errors.HfHubHTTPError) and getattr(err, "response", None) is not None:
            return err.response.status_code
        err = err.__cause__ or err.__context__
    return None


def _short(err: BaseException) -> str:
    """``Type: first line of the message`` (huggingface_hub's messages run over several lines)."""
    text = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _check_hub_reachable(label: str, published: PublishedComponent, filename: str, *, force: bool,
                         architecture_name: str | None) -> None:
    """Ask the hub once for ``filename``'s metadata, without retries; raise WeightsError at once if it is unreachable.

    ``hf_hub_download`` retries an unreachable hub with a backoff (about half a minute) before it
    gives up when nothing is cached. Any HTTP answer (even an error) means the hub is reachable:
    the download then runs, with huggingface_hub's own bounded retries for 5xx answers.
    """
    import huggingface_hub
    from huggingface_hub import constants as hub_constants
    from huggingface_hub import errors as hub_errors

    url = huggingface_hub.hf_hub_url(published.repo_id, filename, revision=published.revision)
    try:
        huggingface_hub.get_hf_file_metadata(url, timeout=hub_constants.HF_HUB_ETAG_TIMEOUT)
    except hub_errors.HfHubHTTPError:
        return
    except Exception as err:  # connection refused, DNS failure, timeout, proxy, TLS
        where = f"{published.repo_id}@{published.revision}"
        why = f"the hub at {hub_constants.ENDPOINT} is unreachable ({_short(err)})"
        if force:
            raise WeightsError(f"cannot download {label!r} again ({where}): {why}; the cached copy, if any, is "
                               f"unchanged. Run it again where the hub is reachable") from None
        raise WeightsError(
            f"cannot get {filename} of {label!r} from the Hugging Face hub repo {where}: {why} and the file is "
            f"not in the cache ({hub_constants.HF_HUB_CACHE}).\n"
            + _fix_lines(label, architecture_name, offline=False)
        ) from None


def _fetch_failure(label: str, published: PublishedComponent, filename: str, err: Exception, *, offline: bool,
                   force: bool, architecture_name: str | None) -> WeightsError:
    """The WeightsError for an ``hf_hub_download`` that failed other than by a missing repo, revision or file."""
    from huggingface_hub import constants as hub_constants
    from huggingface_hub import errors as hub_errors

    where = f"{published.repo_id}@{published.revision}"
    cache = hub_constants.HF_HUB_CACHE
    if offline:
        return WeightsError(
            f"cannot get {filename} of {label!r} from the Hugging Face hub repo {where}: HF_HUB_OFFLINE is set "
            f"and the file is not in the cache ({cache}).\n" + _fix_lines(label, architecture_name, offline=True))
    metadata_failed = isinstance(err, hub_errors.LocalEntryNotFoundError) or (
        isinstance(err, ValueError) and err.__cause__ is not None)  # force_download after a failed metadata request
    cause = err.__cause__ if metadata_failed and err.__cause__ is not None else err
    status = _http_status(cause)
    if metadata_failed:
        if status is not None:
            why = (f"the hub answered HTTP {status} (huggingface_hub retried it and gave up; {_short(cause)}): "
                   f"try again later")
        else:
            why = f"the hub at {hub_constants.ENDPOINT} is unreachable ({_short(cause)})"
        if force:
            return WeightsError(f"cannot download {label!r} again ({where}): {why}; the cached copy, if any, "
                                f"is unchanged")
        return WeightsError(
            f"cannot get {filename} of {label!r} from the Hugging Face hub repo {where}: {why}, and the file is "
            f"not in the cache ({cache}).\n" + _fix_lines(label, architecture_name, offline=False))
    # The metadata came back, the transfer itself failed: huggingface_hub writes to a temporary file
    # and moves it into the cache only when complete, so nothing of this download was kept.
    answered = f"HTTP {status}" if status is not None else _short(err)
    return WeightsError(
        f"downloading {filename} of {label!r} from the Hugging Face hub repo {where} failed part-way "
        f"({answered}); nothing of it was stored in the cache ({cache}).\n"
        f"Fix: run `lopt weights download {label}` again (huggingface_hub resumes or restarts it)")


def _download_component(label: str, published: PublishedComponent, verify_checksum: bool, *, force: bool = False,
                        architecture_name: str | None = None) -> Path:
    """Fetch a component's files through the huggingface_hub cache; return the snapshot directory.

    With ``HF_HUB_OFFLINE`` set only the cache is read (no network attempt, no retries). Online,
    a file that is not cached is fetched only after one quick request has shown that the hub is
    reachable, so an offline machine fails in seconds instead of after huggingface_hub's retries.
    ``label`` is what the user asked for (a registered name or a repo id): the messages' fixes use it.
    """
    import huggingface_hub
    from huggingface_hub import constants as hub_constants
    from huggingface_hub import errors as hub_errors

    offline = hub_constants.is_offline_mode()
    if force and offline:
        raise WeightsError(f"cannot download {label!r} again while HF_HUB_OFFLINE is set: unset it on a machine "
                           f"that reaches the Hugging Face hub")
    directory = None
    reachable = False
    for filename, expected in published.files.items():
        if not offline and not reachable and (force or not _in_cache(published, filename)):
            _check_hub_reachable(label, published, filename, force=force, architecture_name=architecture_name)
            reachable = True
        try:
            local = huggingface_hub.hf_hub_download(published.repo_id, filename, revision=published.revision,
                                                    force_download=force, local_files_only=offline)
        except hub_errors.RepositoryNotFoundError:
            raise WeightsError(f"hub repository {published.repo_id!r} does not exist (or is private); check the repo id") from None
        except hub_errors.RevisionNotFoundError:
            raise WeightsError(f"hub repository {published.repo_id!r} has no revision {published.revision!r}") from None
        except hub_errors.EntryNotFoundError as err:
            if not isinstance(err, hub_errors.LocalEntryNotFoundError):  # the hub answered: the file is not there
                raise WeightsError(f"hub repository {published.repo_id}@{published.revision} has no file {filename!r}") from None
            raise _fetch_failure(label, published, filename, err, offline=offline, force=force,
                                 architecture_name=architecture_name) from None
        except Exception as err:  # offline and not cached, unreachable after retries, a broken transfer, ...
            raise _fetch_failure(label, published, filename, err, offline=offline, force=force,
                                 architecture_name=architecture_name) from None
        local = Path(local)
        if verify_checksum and expected:
            if "size" in expected and local.stat().st_size != expected["size"]:
                raise WeightsError(
                    f"{local} has {local.stat().st_size} bytes, but {published.repo_id}/{filename} has "
                    f"{expected['size']}:\nthe cached file is truncated or not the published one; delete it and "
                    f"download again (`lopt weights download {label} --force`)"
                )
            if expected.get("sha256") and _sha256(local) != expected["sha256"]:
                raise WeightsError(
                    f"checksum mismatch for {local}:\nsha256 {_sha256(local)}, expected {expected['sha256']} for "
                    f"{published.repo_id}/{filename};\nthe file is corrupt or not the published one: delete it and "
                    f"download again (`lopt weights download {label} --force`)"
                )
        directory = local.parent
    return directory


def _in_cache(published: PublishedComponent, filename: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(published.repo_id, filename, revision=published.revision), str)


def _network_label(spec: ArchitectureSpec, comp: ComponentSpec) -> str:
    return spec.name if len(spec.components) == 1 else f"the {comp.name} network of {spec.name}"


def _identify_networks(source) -> tuple[list[tuple[str, str]], list[str]]:
    """Which known networks one directory or file holds: ([(architecture, component)], why each other one does not fit)."""
    matches, mismatches = [], []
    for spec in _ARCHITECTURES.values():
        for comp in spec.components.values():
            try:
                _load_component(comp, source)
            except WeightsError as err:
                mismatches.append(f"as {_network_label(spec, comp)}: {err}")
            else:
                matches.append((spec.name, comp.name))
    return matches, mismatches


def download(source: str, *, force: bool = False) -> list[Path]:
    """Download weights into the Hugging Face cache (or check they are there); return their directories.

    ``source`` is a registered name (every network of the set is fetched, checksums verified; a set
    that ships with lopt is only checked, nothing is downloaded) or a hub repo id
    ``owner/name[@revision]`` (its config.json and model.safetensors are fetched and must hold one of
    the networks lopt knows). ``force`` downloads again even if cached.
    """
    if source in _REGISTERED:
        entry = _REGISTERED[source]
        directories = [_shipped_component(source, published, verify_checksum=True) if published.shipped else
                       _download_component(source, published, verify_checksum=True, force=force,
                                           architecture_name=entry.architecture)
                       for published in entry.components.values()]
        load_weights(source, entry.architecture)  # validates names and shapes too
        return directories
    problem = _repo_id_problem(source)
    if problem is not None:
        raise WeightsError(f"no registered weights named {source!r} (known: {sorted(_REGISTERED)}), and it is not a hub "
                           f"repo id {REPO_ID_FORM} either ({problem})")
    repo_id, revision = _split_revision(source)
    published = PublishedComponent(repo_id, revision or "main", {CONFIG_FILE: None, WEIGHTS_FILE: None})
    directory = _download_component(source, published, verify_checksum=False, force=force)
    matches, mismatches = _identify_networks(directory)
    if not matches:
        raise WeightsError(f"{source} (cached in {directory}) holds none of the networks lopt knows:\n"
                           + "\n".join(f"  - {m}" for m in mismatches))
    return [directory]


def cached_status(name: str) -> str:
    """'cached', 'partly cached' or 'not cached' for a registered weight set (no network access); 'shipped'
    for one whose files ship with lopt ('shipped, files missing' for a damaged installation)."""
    from huggingface_hub import try_to_load_from_cache

    entry = _REGISTERED[name]
    if all(p.shipped for p in entry.components.values()):
        present = all((p.directory() / f).is_file() for p in entry.components.values() for f in p.files)
        return "shipped" if present else "shipped, files missing"
    found = total = 0
    for published in entry.components.values():
        for filename in published.files:
            total += 1
            if published.shipped:
                found += (published.directory() / filename).is_file()
                continue
            hit = try_to_load_from_cache(published.repo_id, filename, revision=published.revision)
            found += isinstance(hit, str)
    return "cached" if found == total else ("partly cached" if found else "not cached")


def verify(source, architecture_name: str | None = None) -> tuple[str, MetaWeights]:
    """Check that ``source`` holds valid weights; return (architecture, weights).

    ``source`` is anything :func:`load_weights` accepts: a directory, a ``.safetensors`` file, a hub
    repo id or a registered name, or, for an architecture of several networks, one source per
    network as a tuple in registry order (VeLO: ``verify((rnn_dir, mlp_dir))``) or a dict
    (``{"rnn": ..., "mlp": ...}``). Without ``architecture_name`` every architecture whose number
    of networks fits ``source`` is tried.
    """
    if architecture_name is not None:
        candidates = [architecture(architecture_name).name]
    elif isinstance(source, (tuple, list)):
        candidates = [name for name, spec in _ARCHITECTURES.items() if len(spec.components) == len(source)]
    elif isinstance(source, Mapping):
        candidates = [name for name, spec in _ARCHITECTURES.items() if set(spec.components) == set(source)]
    else:
        candidates = list(_ARCHITECTURES)
    if not candidates:
        shapes = {name: list(spec.components) for name, spec in _ARCHITECTURES.items()}
        raise WeightsError(f"no architecture has the networks given ({len(source)} sources); the architectures' networks: {shapes}")
    errors = []
    for arch in candidates:
        try:
            return arch, load_weights(source, arch)
        except WeightsError as err:
            errors.append(f"as {arch}: {err}")
    if isinstance(source, (str, os.PathLike)) and Path(os.path.expanduser(str(source))).exists():
        # One network of a several-network architecture (e.g. VeLO's rnn alone): say what it is and what is missing.
        partial = [(a, c) for a, c in _identify_networks(source)[0] if len(_ARCHITECTURES[a].components) > 1]
        if partial:
            arch, comp = partial[0]
            names = list(_ARCHITECTURES[arch].components)
            raise WeightsError(f"{source} holds {_network_label(_ARCHITECTURES[arch], _ARCHITECTURES[arch].components[comp])} "
                               f"only; {arch} needs one source per network {names}: pass them together, "
                               f"verify(({', '.join(n + '_dir' for n in names)}))")
    raise WeightsError(errors[0] if len(errors) == 1 else "\n".join(f"- {e}" for e in errors))
