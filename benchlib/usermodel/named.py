"""Models by name: `hf:NAME_OR_PATH` (a transformers config), `tv:NAME` (torchvision) and `timm:NAME`, each
written as the model file a user would write for it. A name is then run, fitted and gated as that file is (the
same answers by construction); `benchlib new --from NAME FILE` writes the file where the user can change its
loss, batch or optimizer.

Nothing but a config is ever fetched: `hf:` reads a local directory or config.json, else the local Hugging Face
cache, else (where HF_HUB_OFFLINE is not set) the Hub's config.json alone; weights are random. The written file
holds the config itself, so it runs offline and anywhere. Names are refused before any work: a library not
installed names the extra that brings it, an unknown name the closest known ones.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from benchlib.errors import Refused

TASKS = ("causal-lm", "masked-lm", "seq-cls")
DTYPES = ("float32", "bfloat16", "float16")
OPTIMIZERS = ("adamw", "sgd", "adafactor")
MAX_SEQ_LEN = 2048  # the default seq_len: the config's maximum positions, capped here
FALLBACK_SEQ_LEN = 512  # where the config names no maximum
IMAGE_SIZE = 224  # where the model declares no input size


class NamedModelError(Refused):
    """A model name that cannot be written as a model file: its library missing, the name unknown, no config."""


@dataclass(frozen=True)
class Source:
    """One prefix: the library it needs, the extra that installs it, and its writer."""

    library: str
    extra: str
    write: Callable[[str], str]


def is_model_name(text: Any) -> bool:
    """`hf:...`, `tv:...` or `timm:...`, and no file of that name: a model by name."""
    if not isinstance(text, str):
        return False
    prefix, colon, rest = text.partition(":")
    return bool(colon and rest) and prefix in SOURCES and not Path(text).exists()


def model_file_text(name: str) -> str:
    """The model file `name` stands for (NamedModelError, before any work, where it cannot be written)."""
    prefix, _, rest = name.partition(":")
    source = SOURCES.get(prefix)
    if source is None or not rest:
        raise NamedModelError(f"{name!r} is no model name; valid: hf:NAME_OR_PATH, tv:NAME or timm:NAME")
    if importlib.util.find_spec(source.library) is None:
        raise NamedModelError(f"{name}: {prefix}: names need {source.library}, which is not installed; install "
                              f"benchlib's extra: pip install 'benchlib[{source.extra}]'")
    return source.write(rest)


def cache_folder() -> Path:
    """Where the files names stand for are written: $BENCHLIB_CACHE, else $XDG_CACHE_HOME/benchlib (~/.cache)."""
    root = os.environ.get("BENCHLIB_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "benchlib"
    return Path(root) / "models"


def named_model_file(name: str) -> Path:
    """The model file `name` stands for, written (atomically, only when its text changed) in `cache_folder()`."""
    text = model_file_text(name)
    stem = re.search(r'^NAME = "(\w+)"$', text, flags=re.M).group(1)  # the file is named as its records are
    path = cache_folder() / hashlib.sha256(name.encode()).hexdigest()[:12] / f"{stem}.py"
    if not (path.is_file() and path.read_text(encoding="utf-8") == text):
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
    return path


def resolved(text: Any) -> Any:
    """`text` as a model file's path where it is a model name; else `text` unchanged."""
    return str(named_model_file(text)) if is_model_name(text) else text


def _identifier(text: str) -> str:
    name = re.sub(r"[^0-9A-Za-z_]+", "_", text).strip("_").lower()
    return name if name and not name[0].isdigit() else f"m_{name}"


def _imported(library: str):
    """`library` imported, or NamedModelError saying why it cannot be here (a build for another torch, say)."""
    try:
        return importlib.import_module(library)
    except Exception as error:  # noqa: BLE001 - an extension built for another torch fails in many ways
        raise NamedModelError(f"{library} is installed but cannot be imported here ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''}); install the {library} release "
                              f"built for this torch") from None


def _closest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
    return f"; closest: {', '.join(close)}" if close else ""


# ---------------------------------------------------------------- hf: transformers from a config

def _hf_config(target: str) -> tuple[dict, str]:
    """The config's dict and where it came from: a directory or config.json here, the local Hugging Face cache,
    or the Hub's config.json alone (never where HF_HUB_OFFLINE is set)."""
    path = Path(target).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return _read_config(path, target), f"{path.resolve()}"
    if path.suffix == ".json" or os.sep in target and not re.fullmatch(r"[\w.-]+/[\w.-]+", target):
        raise NamedModelError(f"hf:{target}: no such directory or config.json")
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(target, "config.json")
    if isinstance(cached, str):
        return _read_config(Path(cached), target), f"the Hugging Face cache ({cached})"
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    known = _cached_repos()
    if offline:
        raise NamedModelError(f"hf:{target}: not a directory or config.json here, nor in the local Hugging Face cache, "
                              f"and HF_HUB_OFFLINE is set" + _closest(target, known))
    from huggingface_hub import hf_hub_download

    try:
        fetched = hf_hub_download(target, "config.json")  # the config alone: weights are never fetched
    except Exception as error:  # noqa: BLE001 - the Hub's many errors (no network, no such repo) read alike here
        raise NamedModelError(f"hf:{target}: not a directory or config.json here, nor in the local Hugging Face "
                              f"cache, and the Hub gave no config.json ({type(error).__name__}: {error})"
                              + _closest(target, known)) from None
    return _read_config(Path(fetched), target), f"the Hugging Face Hub ({target}, config.json only)"


def _read_config(path: Path, target: str) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise NamedModelError(f"hf:{target}: {path} is not a readable JSON config ({error})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise NamedModelError(f"hf:{target}: {path} names no model_type (a transformers config.json has one)")
    CONFIG_MAPPING = _imported("transformers").CONFIG_MAPPING

    if config["model_type"] not in CONFIG_MAPPING:
        raise NamedModelError(f"hf:{target}: model_type {config['model_type']!r} is not one this transformers knows"
                              + _closest(config["model_type"], list(CONFIG_MAPPING.keys())))
    return config


def _cached_repos() -> list[str]:
    try:
        from huggingface_hub import scan_cache_dir

        return sorted(repo.repo_id for repo in scan_cache_dir().repos)
    except Exception:  # noqa: BLE001 - no cache yet: nothing to suggest
        return []


def _task_of(config: dict) -> str:
    """What the config's architectures say the model is trained for; else a causal language model."""
    for architecture in config.get("architectures") or ():
        if architecture.endswith("ForMaskedLM") or architecture.endswith("ForPreTraining"):
            return "masked-lm"
        if architecture.endswith("ForSequenceClassification"):
            return "seq-cls"
        if architecture.endswith("ForCausalLM") or architecture.endswith("LMHeadModel"):
            return "causal-lm"
    return "causal-lm"


def _seq_len_of(config: dict) -> int:
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return min(config[key], MAX_SEQ_LEN)
    return FALLBACK_SEQ_LEN


def _write_hf(target: str) -> str:
    config, source = _hf_config(target)
    kept = {key: value for key, value in config.items() if key not in ("transformers_version", "_name_or_path")}
    local = Path(target).expanduser()
    stem = (local.resolve().name if local.is_dir() else local.resolve().parent.name if local.name == "config.json"
            else local.stem) if local.exists() else target  # a directory's name, or the Hub's repo id
    labels = len(config.get("id2label") or {}) or config.get("num_labels") or 2
    return HF_TEMPLATE.format(
        name=target, source=source, model_type=config["model_type"], ident=_identifier(f"hf_{stem}"),
        config=_literal(kept), task=_task_of(config), seq_len=_seq_len_of(config), labels=labels, tasks=TASKS,
        dtypes=DTYPES, optimizer_code=OPTIMIZER_CODE.format(optimizers=OPTIMIZERS))


def _literal(config: dict) -> str:
    """The config as a Python literal (JSON's true, false and null as Python's), one key a line."""
    lines = [f"    {key!r}: {value!r}," for key, value in config.items()]
    return "{\n" + "\n".join(lines) + "\n}"


OPTIMIZER_CODE = '''

def optimizer(parameters, **params):
    """The optimizer `-p optimizer=` names (adamw, sgd or adafactor)."""
    chosen = params["optimizer"]
    if chosen == "adamw":
        return torch.optim.AdamW(parameters, lr=1e-4)
    if chosen == "sgd":
        return torch.optim.SGD(parameters, lr=1e-3, momentum=0.9)
    if chosen == "adafactor":
        return torch.optim.Adafactor(parameters, lr=1e-2)
    raise ValueError(f"optimizer={{chosen!r}}: valid values are {optimizers}")
'''

HF_TEMPLATE = '''"""{model_type} from transformers' config, random weights: the model file `hf:{name}` stands for.

Its config came from {source}
and is written below, so this file runs offline. The batch is random token ids; the loss is the model's own
(labels: the ids, or random classes for seq-cls). Change anything here: it is a model file like any other
(`benchlib run THIS_FILE --quick`).
"""

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSequenceClassification

NAME = "{ident}"
CONFIG = {config}
# task: {tasks}; dtype: {dtypes}; optimizer: see optimizer() below
PARAMETERS = {{"batch_size": 8, "seq_len": {seq_len}, "task": "{task}", "dtype": "float32", "optimizer": "adamw"}}
QUICK = {{"batch_size": 1, "seq_len": 32}}
LABELS = {labels}  # the classes a seq-cls head predicts
HEADS = {{"causal-lm": AutoModelForCausalLM, "masked-lm": AutoModelForMaskedLM,
         "seq-cls": AutoModelForSequenceClassification}}


def _chosen(task, dtype):
    if task not in HEADS:
        raise ValueError(f"task={{task!r}}: valid values are {tasks}")
    if dtype not in {dtypes}:
        raise ValueError(f"dtype={{dtype!r}}: valid values are {dtypes}")
    return HEADS[task], getattr(torch, dtype)


def model(batch_size, seq_len, task, dtype, optimizer):
    head, dtype = _chosen(task, dtype)
    return head.from_config(AutoConfig.for_model(**CONFIG), dtype=dtype).train()


def batch(batch_size, seq_len, task, dtype, optimizer):
    _chosen(task, dtype)
    ids = torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len))
    return (ids, torch.randint(0, LABELS, (batch_size,))) if task == "seq-cls" else (ids,)


def loss(model, ids, labels=None):
    """The model's own loss: next (or masked) tokens of the ids themselves, or the random classes."""
    return model(input_ids=ids, labels=ids if labels is None else labels).loss
{optimizer_code}'''


# ---------------------------------------------------------------- tv: and timm: image classifiers

def _write_tv(target: str) -> str:
    torchvision = _imported("torchvision")
    _imported("torchvision.models")
    known = torchvision.models.list_models(module=torchvision.models)  # the classification models
    if target not in known:
        others = torchvision.models.list_models()
        what = (" is a torchvision model, but not an image classifier (tv: names take the classification models)"
                if target in others else " is no torchvision classification model")
        raise NamedModelError(f"tv:{target}{what}" + _closest(target, known))
    size = IMAGE_SIZE
    try:
        crop = torchvision.models.get_model_weights(target).DEFAULT.transforms().crop_size
        size = int(crop[0] if isinstance(crop, (list, tuple)) else crop)
    except (AttributeError, TypeError, ValueError, IndexError):
        pass
    return IMAGE_TEMPLATE.format(
        label=f"torchvision's {target}", name=f"tv:{target}", ident=_identifier(f"tv_{target}"), size=size,
        imports="import torchvision", build=f'torchvision.models.get_model("{target}", weights=None, '
                                            f'num_classes=num_classes)',
        optimizers=OPTIMIZERS, optimizer_code=OPTIMIZER_CODE.format(optimizers=OPTIMIZERS))


def _write_timm(target: str) -> str:
    timm = _imported("timm")
    known = timm.list_models()
    if target not in known:
        raise NamedModelError(f"timm:{target} is no timm model" + _closest(target, known))
    size = IMAGE_SIZE
    config = timm.get_pretrained_cfg(target)
    if config is not None and getattr(config, "input_size", None):
        size = int(config.input_size[-1])
    return IMAGE_TEMPLATE.format(
        label=f"timm's {target}", name=f"timm:{target}", ident=_identifier(f"timm_{target}"), size=size,
        imports="import timm", build=f'timm.create_model("{target}", pretrained=False, num_classes=num_classes, '
                                     f'**({{}} if image_size == {size} else {{"img_size": image_size}}))',
        optimizers=OPTIMIZERS, optimizer_code=OPTIMIZER_CODE.format(optimizers=OPTIMIZERS))


IMAGE_TEMPLATE = '''"""{label}, random weights: the model file `{name}` stands for.

The batch is random images and classes; the loss is cross-entropy over the logits. Change anything here: it is a
model file like any other (`benchlib run THIS_FILE --quick`).
"""

import torch
{imports}

NAME = "{ident}"
# dtype: float32, bfloat16 or float16; optimizer: see optimizer() below
PARAMETERS = {{"batch_size": 32, "image_size": {size}, "num_classes": 1000, "dtype": "float32", "optimizer": "adamw"}}
QUICK = {{"batch_size": 2}}


def model(batch_size, image_size, num_classes, dtype, optimizer):
    return {build}.to(getattr(torch, dtype)).train()


def batch(batch_size, image_size, num_classes, dtype, optimizer):
    images = torch.randn(batch_size, 3, image_size, image_size, dtype=getattr(torch, dtype))
    return images, torch.randint(0, num_classes, (batch_size,))


def loss(model, images, labels):
    out = model(images)
    logits = getattr(out, "logits", out)  # Inception and GoogLeNet train with auxiliary outputs beside the logits
    return torch.nn.functional.cross_entropy(logits, labels)
{optimizer_code}'''


SOURCES = {"hf": Source("transformers", "hf", _write_hf), "tv": Source("torchvision", "vision", _write_tv),
           "timm": Source("timm", "vision", _write_timm)}
